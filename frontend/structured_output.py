"""Structured output: a request's constraint compiled into the token automaton the engine follows
(blink_appliance/wire/automaton.py).

What the API names becomes one regex: `response_format` `json_schema` (and vLLM's `guided_json`)
through outlines-core's JSON-schema regex builder, `json_object` as any object nesting two levels,
vLLM's `guided_regex` as it is, `guided_choice` as an alternation of the escaped choices.
outlines-core then builds the automaton of that regex over the model's token bytes (special tokens
left out; end of sequence allowed in accepting states). Compiled automata are cached by regex: one
compiler per model, so per tokenizer too.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from blink_appliance.frontend.errors import APIError, bad_request
from blink_appliance.frontend.logprobs import TokenStrings

from blink_appliance.wire.automaton import TokenAutomaton

if TYPE_CHECKING:
    from outlines_core import Vocabulary

# outlines-core is imported where it is used: a request without a constraint must not load it.

CACHE_SIZE = 64  # compiled automata kept per model


def _members(value: str) -> str:
    """A JSON object whose member values are `value`."""
    from outlines_core.json_schema import STRING, WHITESPACE

    member = f"{STRING}{WHITESPACE}:{WHITESPACE}{value}"
    return rf"\{{{WHITESPACE}({member}({WHITESPACE},{WHITESPACE}{member})*)?{WHITESPACE}\}}"


def _json_object_regex() -> str:
    """`json_object`: any JSON object whose values nest at most two levels. outlines-core's schema
    {"type": "object"} nests deeper and compiles to ~6.6M words over a 49k vocabulary (12 s); this
    one stays small."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, WHITESPACE

    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    flat_array = rf"\[{WHITESPACE}({scalar}({WHITESPACE},{WHITESPACE}{scalar})*)?{WHITESPACE}\]"
    return _members(f"({scalar}|{flat_array}|{_members(scalar)})")


def constraint_regex(
    response_format: Any, guided_json: Any, guided_regex: str | None, guided_choice: list[str] | None
) -> tuple[str, str] | None:
    """(regex, the parameter it came from) of a request's constraint; None when it has none."""
    given = [
        name
        for name, value in (
            ("response_format", response_format if response_format not in (None, {"type": "text"}) else None),
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise bad_request(f"give one constraint at most, not {' and '.join(given)}", given[1])
    if not given:
        return None
    param = given[0]
    if param == "guided_regex":
        return guided_regex, param
    if param == "guided_choice":
        if not guided_choice or not all(isinstance(c, str) and c for c in guided_choice):
            raise bad_request("guided_choice must be a non-empty list of non-empty strings", param)
        return "(" + "|".join(re.escape(c) for c in guided_choice) + ")", param
    if (
        param == "response_format"
        and isinstance(response_format, dict)
        and response_format.get("type") == "json_object"
    ):
        return _json_object_regex(), param
    from outlines_core.json_schema import build_regex_from_schema

    schema = guided_json if param == "guided_json" else _response_format_schema(response_format)
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return build_regex_from_schema(text), param
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{param}: the JSON schema cannot be compiled: {exc}", param) from None


def _response_format_schema(response_format: Any) -> Any:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema (an object)", "response_format"
            )
        return spec["schema"]
    raise bad_request(
        "response_format type must be 'text', 'json_object' or 'json_schema'", "response_format"
    )


class ConstraintCompiler:
    """Regexes to token automata over one model's vocabulary, cached; automata past `max_words`
    words are refused (they would not fit the engine's constraint area)."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_words: int) -> None:
        if not eos_token_ids:
            raise ValueError("structured output needs the model's end-of-sequence token")
        self.tokenizer = tokenizer
        self.eos = tuple(eos_token_ids)
        self.max_words = max_words
        self._vocabulary: Vocabulary | None = None
        self._cache: OrderedDict[str, TokenAutomaton] = OrderedDict()

    def _vocab(self) -> Vocabulary:
        from outlines_core import Vocabulary

        if self._vocabulary is None:
            strings = TokenStrings(self.tokenizer)
            special = {
                i for i, t in self.tokenizer.backend.get_added_tokens_decoder().items() if t.special
            } | set(self.eos)
            by_bytes: dict[bytes, list[int]] = {}
            for i in range(self.tokenizer.vocab_size):
                if i not in special and self.tokenizer.id_to_token(i) is not None:
                    piece = bytes(strings.bytes(i))
                    if piece:
                        by_bytes.setdefault(piece, []).append(i)
            self._vocabulary = Vocabulary(self.eos[0], by_bytes)
        return self._vocabulary

    def compile(self, regex: str, param: str) -> TokenAutomaton:
        """The automaton of `regex`; a 400 naming `param` when it cannot be built or is too large."""
        if regex in self._cache:
            self._cache.move_to_end(regex)
            return self._cache[regex]
        from outlines_core import Index

        try:
            index = Index(regex, self._vocab())
        except (ValueError, RuntimeError, TypeError) as exc:
            raise bad_request(f"{param}: the constraint cannot be compiled: {exc}", param) from None
        automaton = TokenAutomaton.from_transitions(
            index.get_initial_state(), index.get_transitions(), set(index.get_final_states()), set(self.eos)
        )
        if automaton.num_words > self.max_words:
            raise APIError(
                400,
                f"{param}: the constraint compiles to {automaton.num_words} words, more than this "
                f"appliance's limit of {self.max_words} (frontend.constraint_words); simplify it",
                param=param,
                code="constraint_too_large",
            )
        self._cache[regex] = automaton
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return automaton

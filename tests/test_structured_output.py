"""Structured output in the CPU reference engine on SmolLM2: outputs under a JSON schema, a regex or
a choice always match it, greedy and sampled at temperature 1.0 (jsonschema validates them); the
automaton's wire form round-trips and is checked when read back; the front end's compile errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from blink_appliance.frontend.errors import APIError
from blink_appliance.frontend.structured_output import ConstraintCompiler, constraint_regex

from blink_appliance.wire.automaton import TokenAutomaton
from blink_appliance.wire.request import Request, SamplingParams

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enum-array-number": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "scores", "ok"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
}


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    from blink_appliance.model.loaders import build_model, load_checkpoint
    from blink_appliance.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path)
    model = build_model(load_checkpoint(f"gguf:{smollm2_gguf_path}"), torch.float32, "cpu")
    return tok, model, ConstraintCompiler(tok, tok.eos_token_ids, 1 << 22)


def _generate(
    smollm2, prompt: str, automaton: TokenAutomaton, temperature: float, seed: int, repetition: float = 1.0
) -> str:
    from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine

    tok, model, _ = smollm2
    engine = LLMEngine(model, EngineConfig(max_model_len=512, seed=0))
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=120,
        constraint=automaton,
        repetition_penalty=repetition,
    )
    out = engine.generate([Request(0, ids, params)])[0]
    assert out[-1] in tok.eos_token_ids, (
        f"ran out of tokens before the constraint accepted: {tok.decode(out)!r}"
    )
    return tok.decode(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 7)])
def test_outputs_validate_against_their_json_schema(smollm2, name, temperature, seed):
    schema = SCHEMAS[name]
    regex, param = constraint_regex(
        {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}, None, None, None
    )
    automaton = smollm2[2].compile(regex, param)
    text = _generate(smollm2, f"Give me an example of {name} data as JSON.", automaton, temperature, seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 3)])
def test_regex_choice_and_json_object_constrain_the_output(smollm2, temperature, seed):
    compiler = smollm2[2]
    regex, param = constraint_regex(None, None, r"[0-9]{3}-[a-z]{2,4}", None)
    text = _generate(smollm2, "Say something.", compiler.compile(regex, param), temperature, seed)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    regex, param = constraint_regex(None, None, None, ["yes", "no", "maybe later"])
    assert _generate(smollm2, "Is the sky blue?", compiler.compile(regex, param), temperature, seed) in {
        "yes",
        "no",
        "maybe later",
    }


def test_json_object_gives_an_object(smollm2):
    regex, param = constraint_regex({"type": "json_object"}, None, None, None)
    automaton = smollm2[2].compile(regex, param)
    # Greedy SmolLM2 repeats one key forever here; a repetition penalty lets it close the object.
    assert isinstance(json.loads(_generate(smollm2, "A person as JSON.", automaton, 0.0, 0, 1.3)), dict)


def test_the_wire_form_round_trips_and_is_checked(smollm2):
    regex, param = constraint_regex(None, None, None, ["alpha", "beta"])
    a = smollm2[2].compile(regex, param)
    words = a.to_words()
    b = TokenAutomaton.from_words(words, 49152)
    assert (
        b.initial == a.initial and np.array_equal(b.tokens, a.tokens) and np.array_equal(b.targets, a.targets)
    )
    assert np.array_equal(b.accepting, a.accepting) and words.shape[0] == a.num_words
    bad = words.copy()
    bad[-1] = a.num_states  # an edge into a state that does not exist
    with pytest.raises(ValueError, match="out of range"):
        TokenAutomaton.from_words(bad, 49152)
    with pytest.raises(ValueError, match="does not hold"):
        TokenAutomaton.from_words(words[:-1], 49152)
    with pytest.raises(ValueError, match="out of range"):
        TokenAutomaton.from_words(words, int(a.tokens.max()))  # a token outside the vocabulary


def test_bad_constraints_get_a_400_naming_the_parameter(smollm2):
    compiler = smollm2[2]
    for args, param in (
        ((None, None, "(", None), "guided_regex"),
        (({"type": "json_schema"}, None, None, None), "response_format"),
        (({"type": "xml"}, None, None, None), "response_format"),
        ((None, None, None, []), "guided_choice"),
        (({"type": "json_object"}, None, "a", None), "guided_regex"),
    ):
        with pytest.raises(APIError) as info:
            regex, p = constraint_regex(*args)
            compiler.compile(regex, p)
        assert info.value.status == 400 and info.value.param == param, (args, info.value)
    small = ConstraintCompiler(smollm2[0], smollm2[0].eos_token_ids, 1000)
    regex, p = constraint_regex({"type": "json_object"}, None, None, None)
    with pytest.raises(APIError, match="limit of 1000"):
        small.compile(regex, p)


def test_a_request_without_a_constraint_does_not_need_outlines_core():
    """The front end looks every request's constraint up; one without must not load outlines-core
    (a serving install that failed to get it still serves plain requests)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['outlines_core'] = None  # import outlines_core now raises ImportError\n"
        "from blink_appliance.frontend.structured_output import ConstraintCompiler, constraint_regex\n"
        "assert constraint_regex(None, None, None, None) is None\n"
        "assert constraint_regex({'type': 'text'}, None, 'a+', None) == ('a+', 'guided_regex')\n"
        "ConstraintCompiler(None, (2,), 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

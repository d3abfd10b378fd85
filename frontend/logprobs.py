"""Logprobs in OpenAI's response shapes (docs/api.md, "Logprobs"): the completions form (tokens,
token_logprobs, top_logprobs, text_offset) and the chat form (content: token, logprob, bytes,
top_logprobs), from the engine's per-position TokenLogprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from tokenizers import decoders

from blink_appliance.wire.request import TokenLogprobs


class _TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


@dataclass(frozen=True)
class LogprobEntry:
    """One position of a choice's text, with where its text starts in that text."""

    token_id: int
    logprob: float | None  # None: the prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...] | None
    offset: int

    @classmethod
    def of(cls, lp: TokenLogprobs, offset: int) -> LogprobEntry:
        return cls(lp.token_id, lp.logprob, lp.top, offset)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: which byte each printable stand-in character is."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenStrings:
    """A vocabulary's token strings and bytes, cached: a token's own text, decoded alone."""

    def __init__(self, tokenizer: _TokenDecoder) -> None:
        self.tokenizer = tokenizer
        # Byte-level BPE spells each byte as one character of GPT-2's alphabet: a token's bytes are
        # exact from its spelling, even when it ends mid-character.
        self.byte_level = isinstance(
            getattr(getattr(tokenizer, "backend", None), "decoder", None), decoders.ByteLevel
        )
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes: exact for byte-level BPE (a token may end mid-character), else
        those of its text."""
        piece = self.tokenizer.id_to_token(token_id) if self.byte_level else None
        table = _byte_decoder()
        if piece and all(c in table for c in piece):
            return [table[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def completion_logprobs(entries: Sequence[LogprobEntry], strings: TokenStrings) -> dict[str, Any]:
    """The completions form. As vLLM does, top_logprobs holds the chosen token too (so a position
    has N or N + 1 entries)."""
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e.top is None:
            tops.append(None)
            continue
        top = {strings.text(t): lp for t, lp in e.top}
        top.setdefault(strings.text(e.token_id), e.logprob)  # type: ignore[arg-type]
        tops.append(top)
    return {
        "tokens": [strings.text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": [e.offset for e in entries],
    }


def chat_logprobs(entries: Sequence[LogprobEntry], strings: TokenStrings) -> dict[str, Any]:
    """The chat form: each position's token, logprob, bytes and its N most likely alternatives."""

    def item(token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"token": strings.text(token_id), "logprob": logprob, "bytes": strings.bytes(token_id)}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top or ()]}
            for e in entries
        ]
    }


class ChoiceLogprobs:
    """A choice's entries in the order its text grows: each token's entry starts where the text of
    every token before it ended (tokens held back mid-character share an offset)."""

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted
        self.offset = 0
        self._entries: list[LogprobEntry] = []

    def prompt(
        self, ids: Sequence[int], deltas: Sequence[str], scored: Sequence[TokenLogprobs] | None
    ) -> None:
        """The echoed prompt: its first token has no logprob; `scored` covers positions 1.. ."""
        for i, (token_id, delta) in enumerate(zip(ids, deltas, strict=True)):
            if self.wanted and scored is not None:
                lp = scored[i - 1] if i else None
                self._entries.append(
                    LogprobEntry(token_id, None, None, self.offset)
                    if lp is None
                    else LogprobEntry.of(lp, self.offset)
                )
            self.offset += len(delta)

    def token(self, lp: TokenLogprobs | None, delta: str) -> None:
        if self.wanted and lp is not None:
            self._entries.append(LogprobEntry.of(lp, self.offset))
        self.offset += len(delta)

    @property
    def pending(self) -> bool:
        return bool(self._entries)

    def take(self) -> tuple[LogprobEntry, ...]:
        """The entries since the last take (one streamed chunk's)."""
        entries, self._entries = tuple(self._entries), []
        return entries

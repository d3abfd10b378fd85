"""Streaming detokenization: text deltas per generated token, never half a UTF-8 character.

Byte-level BPE tokens can end mid-character (an emoji may take several tokens), and how a token
decodes depends on its left neighbours (spaces, byte merges). So each step decodes a short window
of recent ids twice, with and without the new tokens, and emits only the difference; while the
window's text ends in U+FFFD the bytes are incomplete and we hold them back.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# How many prompt tokens to keep as left context for the first generated tokens.
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: _Decoder, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        self._ids: list[int] = context  # the decode window: left context, then ids not yet emitted
        self._read = len(context)  # ids before this index are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        before = self._decode(self._ids[: self._read])
        after = self._decode(self._ids)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        # Slide the window: the newly emitted ids become the next window's left context.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return after[len(before) :]

    def feed(self, token_id: int) -> str:
        """Text completed by this token (often "", e.g. mid-character or a skipped special token)."""
        self._ids.append(int(token_id))
        return self._delta(final=False)

    def hold(self, token_id: int) -> str:
        """Take a token whose text is wanted only at the end (a whole response): nothing is decoded
        now, and the next feed or flush decodes every held token at once. Returns ""."""
        self._ids.append(int(token_id))
        return ""

    def flush(self) -> str:
        """Whatever is still held back (incomplete bytes decode to U+FFFD, as a full decode would)."""
        return self._delta(final=True)

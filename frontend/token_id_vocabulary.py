"""Serving a model that has no tokenizer (`dummy:` presets): prompts as token ids, output text as ids.

Like vLLM with `skip_tokenizer_init`, /v1/completions takes the prompt as a list of token ids.
The output has no text of its own, so each generated token is written as its id in decimal after
a space (" 17 4096 5"): every token is one non-empty piece of a stream (so clients time it as a
token) and the ids can be read back from the text. A text prompt, and chat (which needs a chat
template), are refused with 400 saying to send token ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from blink_appliance.frontend.errors import bad_request


def token_ids_text(ids: Iterable[int]) -> str:
    """The text of generated ids for a model without a tokenizer: " <id>" per token."""
    return "".join(f" {int(i)}" for i in ids)


class TokenIdVocabulary:
    """Stands in for a tokenizer where the front end needs one; see the module docstring."""

    def __init__(self, vocab_size: int, source: str) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.source = source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise bad_request(
            f"the model {self.source} has no tokenizer: send the prompt as a list of token ids "
            f"(each in [0, {self.vocab_size}))",
            "prompt",
            "tokenizer_unavailable",
        )

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> Any:
        raise bad_request(
            f"the model {self.source} has no tokenizer and no chat template: use /v1/completions "
            "with a token-id prompt",
            "messages",
            "tokenizer_unavailable",
        )

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return token_ids_text(ids)


def token_id_vocabulary_for(source: str) -> TokenIdVocabulary | None:
    """The stand-in for a `dummy:` model source (its preset's vocabulary); None for any other source."""
    kind, sep, preset = source.partition(":")
    if kind != "dummy" or not sep:
        return None
    from blink_appliance.model.presets import preset_config

    return TokenIdVocabulary(preset_config(preset).vocab_size, source)

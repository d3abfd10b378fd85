"""Benchmark prompts: synthetic text of a controlled token length, random token ids, or ShareGPT.

- `synthetic`: text made of words that are each one token of the model's tokenizer, so a prompt
  of N tokens is N words (plus the special tokens the tokenizer adds), checked by encoding it.
- `random`: uniformly drawn token ids (special tokens left out), sent as the token-id prompt of
  /v1/completions: exactly N prompt tokens, whatever the tokenizer's merges would do to text.
- `sharegpt:PATH`: a ShareGPT-format JSON file (a list of {"conversations": [{"from", "value"}, ...]});
  the first turn is the prompt and, unless an output length is given, the second turn's token
  count is the output length.

Input and output lengths are a fixed number or a uniform integer range ("128" or "64-256").
Everything is drawn from one `random.Random(seed)`, so a seed gives the same prompts.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DATASET_KINDS = ("synthetic", "random", "sharegpt:PATH")

# Lower-case words with their leading space: BPE pre-tokenizers split text at spaces, so a
# sequence of such words encodes to one token per word.
_WORD = re.compile(r" [a-z]{2,12}")
_MIN_WORDS = 64


class BenchTokenizer(Protocol):
    """What the datasets need from a tokenizer (blink_appliance.model.tokenizer.Tokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class LengthRange:
    """A token length: fixed (low == high) or drawn uniformly from [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, what: str = "length") -> LengthRange:
        lo_text, sep, hi_text = str(text).strip().partition("-")
        try:
            low = int(lo_text)
            high = int(hi_text) if sep else low
        except ValueError:
            raise ValueError(f"{what}: expected N or LOW-HIGH (token counts), got {text!r}") from None
        if low < 1 or high < low:
            raise ValueError(f"{what}: need 1 <= LOW <= HIGH, got {text!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (the /v1/completions token-id prompt)
    input_len: int | None  # prompt tokens as the tokenizer counts them; None without a tokenizer
    output_len: int  # max_tokens asked for

    @property
    def is_token_ids(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class DatasetSpec:
    kind: str  # "synthetic" | "random" | "sharegpt"
    path: Path | None = None

    @classmethod
    def parse(cls, text: str) -> DatasetSpec:
        kind, sep, rest = text.partition(":")
        if kind in ("synthetic", "random") and not sep:
            return cls(kind)
        if kind == "sharegpt" and rest:
            return cls(kind, Path(rest))
        raise ValueError(f"--dataset: expected one of {', '.join(DATASET_KINDS)}, got {text!r}")

    def __str__(self) -> str:
        return f"sharegpt:{self.path}" if self.kind == "sharegpt" else self.kind


@functools.cache
def load_bench_tokenizer(source: str) -> BenchTokenizer:
    """The tokenizer of a model source (named, gguf:, hf:); cached, since loading one takes seconds."""
    from blink_appliance.model.sources import load_tokenizer

    tok = load_tokenizer(source)
    if tok is None:
        raise ValueError(f"model source {source!r} has no tokenizer; pass --tokenizer with one that does")
    return tok


def special_token_ids(tok: BenchTokenizer) -> set[int]:
    """BOS, EOS and the added special tokens: kept out of random prompts."""
    ids: set[int] = set()
    bos = getattr(tok, "bos_token_id", None)
    if bos is not None:
        ids.add(int(bos))
    ids.update(int(i) for i in getattr(tok, "eos_token_ids", ()) or ())
    backend = getattr(tok, "backend", None)
    added = getattr(backend, "get_added_tokens_decoder", None)
    if added is not None:
        ids.update(int(i) for i, token in added().items() if getattr(token, "special", False))
    return ids


@functools.cache
def _single_token_words_cached(tok: BenchTokenizer) -> tuple[str, ...]:
    words = []
    for token_id in range(tok.vocab_size):
        piece = tok.decode([token_id])
        if _WORD.fullmatch(piece) and tok.encode(piece, add_special_tokens=False) == [token_id]:
            words.append(piece)
    return tuple(words)


def single_token_words(tok: BenchTokenizer) -> tuple[str, ...]:
    """Every " word" (leading space, lower case) that the tokenizer encodes as exactly one token."""
    words = _single_token_words_cached(tok)
    if len(words) < _MIN_WORDS:
        raise ValueError(
            f"the tokenizer has only {len(words)} single-token words, too few for synthetic text; "
            "use --dataset random"
        )
    return words


def _added_special_count(tok: BenchTokenizer, sample_text: str) -> int:
    return len(tok.encode(sample_text, add_special_tokens=True)) - len(
        tok.encode(sample_text, add_special_tokens=False)
    )


def text_of_length(
    tok: BenchTokenizer, words: tuple[str, ...], num_tokens: int, rng: random.Random
) -> tuple[str, int]:
    """Text that encodes (with the tokenizer's special tokens, as a completions server counts)
    to `num_tokens` tokens; returns the text and the count it really has."""
    special = _added_special_count(tok, words[0])
    picked = [rng.choice(words) for _ in range(max(1, num_tokens - special))]
    actual = len(tok.encode("".join(picked), add_special_tokens=True))
    # A merge across a word boundary is rare but possible: trim or extend until the count is exact.
    for _ in range(16):
        if actual == num_tokens:
            break
        if actual > num_tokens and len(picked) > 1:
            picked.pop()
        elif actual < num_tokens:
            picked.append(rng.choice(words))
        else:
            break
        actual = len(tok.encode("".join(picked), add_special_tokens=True))
    return "".join(picked), actual


def synthetic_requests(
    tok: BenchTokenizer,
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    rng: random.Random,
) -> list[BenchRequest]:
    words = single_token_words(tok)
    out = []
    for _ in range(num_prompts):
        text, actual = text_of_length(tok, words, input_len.sample(rng), rng)
        out.append(BenchRequest(text, actual, output_len.sample(rng)))
    return out


def random_token_requests(
    vocab_size: int,
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    rng: random.Random,
    *,
    exclude: set[int] | frozenset[int] = frozenset(),
) -> list[BenchRequest]:
    if vocab_size - len(exclude) < 1:
        raise ValueError(f"vocabulary of {vocab_size} ids has nothing left to draw from")
    out = []
    for _ in range(num_prompts):
        ids: list[int] = []
        n = input_len.sample(rng)
        while len(ids) < n:
            token_id = rng.randrange(vocab_size)
            if token_id not in exclude:
                ids.append(token_id)
        out.append(BenchRequest(ids, n, output_len.sample(rng)))
    return out


def _conversation_turns(entry: Any) -> list[str] | None:
    turns = entry.get("conversations", entry.get("conversation")) if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value") for t in turns[:2] if isinstance(t, dict)]
    if len(texts) < 2 or not all(isinstance(t, str) for t in texts) or not texts[0].strip():
        return None
    return texts  # type: ignore[return-value]


def sharegpt_requests(
    path: Path,
    num_prompts: int,
    rng: random.Random,
    *,
    tok: BenchTokenizer | None,
    output_len: LengthRange | None,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """`num_prompts` conversations drawn (shuffled by `rng`) from a ShareGPT JSON file.

    Without a tokenizer, input lengths are unknown (the server's usage still reports them) and an
    output length must be given. Conversations whose prompt plus output exceed `max_model_len`,
    or whose reply is empty, are skipped."""
    if output_len is None and tok is None:
        raise ValueError("sharegpt: the reply lengths need a tokenizer (--tokenizer) or give --output-len")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"sharegpt: no such file {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sharegpt: {path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"sharegpt: {path} must hold a JSON list of conversations")
    order = list(range(len(data)))
    rng.shuffle(order)
    out: list[BenchRequest] = []
    for index in order:
        turns = _conversation_turns(data[index])
        if turns is None:
            continue
        prompt, reply = turns
        n_in = len(tok.encode(prompt, add_special_tokens=True)) if tok is not None else None
        if output_len is not None:
            n_out = output_len.sample(rng)
        else:
            n_out = len(tok.encode(reply, add_special_tokens=False))  # type: ignore[union-attr]
        if n_out < 1:
            continue
        if max_model_len is not None and n_in is not None and n_in + n_out > max_model_len:
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == num_prompts:
            return out
    raise ValueError(
        f"sharegpt: {path} has {len(out)} usable conversations, fewer than --num-prompts {num_prompts}"
    )


def build_requests(
    spec: DatasetSpec,
    num_prompts: int,
    *,
    seed: int,
    input_len: LengthRange,
    output_len: LengthRange | None,
    tokenizer: BenchTokenizer | None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """The requests of a run. `output_len` None means "from the data" (ShareGPT only)."""
    if num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    rng = random.Random(seed)
    if spec.kind == "sharegpt":
        assert spec.path is not None
        return sharegpt_requests(
            spec.path, num_prompts, rng, tok=tokenizer, output_len=output_len, max_model_len=max_model_len
        )
    if output_len is None:
        raise ValueError(f"--dataset {spec.kind} needs --output-len")
    if spec.kind == "synthetic":
        if tokenizer is None:
            raise ValueError("--dataset synthetic needs a tokenizer to control prompt lengths (--tokenizer)")
        return synthetic_requests(tokenizer, num_prompts, input_len, output_len, rng)
    if tokenizer is not None:
        vocab, exclude = tokenizer.vocab_size, special_token_ids(tokenizer)
    elif vocab_size is not None:
        vocab, exclude = vocab_size, set()
    else:
        raise ValueError("--dataset random needs the vocabulary size: --tokenizer or --vocab-size")
    return random_token_requests(vocab, num_prompts, input_len, output_len, rng, exclude=exclude)

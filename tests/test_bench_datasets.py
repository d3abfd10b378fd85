"""bench datasets: length specs, synthetic text of exact token lengths, random ids, ShareGPT files.

A small byte-level BPE tokenizer is trained here in milliseconds (the real SmolLM2 one takes
seconds to load; the live test in test_bench_serve_live.py uses it end to end).
"""

from __future__ import annotations

import json
import random

import pytest

from blink_appliance.bench.datasets import (
    DatasetSpec,
    LengthRange,
    build_requests,
    random_token_requests,
    sharegpt_requests,
    single_token_words,
    special_token_ids,
    synthetic_requests,
)

_SYLLABLES = ["ka", "lo", "mi", "ne", "po", "ru", "sa", "ti", "vo", "ze", "bra", "glu"]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from blink_appliance.model.tokenizer import Tokenizer as BlinkTokenizer

    words = [a + b for a in _SYLLABLES for b in _SYLLABLES]  # 144 distinct words
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 3
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    # Like Llama: every encoded text starts with BOS, which the server counts as a prompt token.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return BlinkTokenizer(backend, bos_token_id=0, eos_token_ids=(1,))


def test_length_range_parse_and_sample():
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse(" 64-256 ") == LengthRange(64, 256)
    assert str(LengthRange(64, 256)) == "64-256" and str(LengthRange(5, 5)) == "5"
    rng = random.Random(0)
    draws = {LengthRange(3, 5).sample(rng) for _ in range(200)}
    assert draws == {3, 4, 5}
    for bad in ("0", "5-4", "abc", "-3", "1-x"):
        with pytest.raises(ValueError, match="--input-len"):
            LengthRange.parse(bad, "--input-len")


def test_dataset_spec_parse(tmp_path):
    assert DatasetSpec.parse("synthetic") == DatasetSpec("synthetic")
    assert DatasetSpec.parse("random").kind == "random"
    spec = DatasetSpec.parse(f"sharegpt:{tmp_path}/d.json")
    assert spec.kind == "sharegpt" and spec.path == tmp_path / "d.json"
    assert str(spec) == f"sharegpt:{tmp_path}/d.json"
    for bad in ("sharegpt", "sharegpt:", "random:x", "sonnet"):
        with pytest.raises(ValueError, match="--dataset"):
            DatasetSpec.parse(bad)


def test_single_token_words_are_single_tokens(tok):
    words = single_token_words(tok)
    assert len(words) >= 64
    for w in words:
        assert w.startswith(" ") and tok.encode(w, add_special_tokens=False).__len__() == 1


def test_synthetic_prompts_have_the_exact_token_count(tok):
    reqs = synthetic_requests(tok, 30, LengthRange(2, 40), LengthRange(3, 3), random.Random(5))
    lengths = set()
    for r in reqs:
        assert isinstance(r.prompt, str) and r.output_len == 3
        # the count includes BOS, as a completions server counts the prompt
        assert len(tok.encode(r.prompt, add_special_tokens=True)) == r.input_len
        lengths.add(r.input_len)
    assert len(lengths) > 10 and min(lengths) >= 2 and max(lengths) <= 40  # drawn across the range
    fixed = synthetic_requests(tok, 10, LengthRange(17, 17), LengthRange(3, 3), random.Random(6))
    assert [len(tok.encode(r.prompt)) for r in fixed] == [17] * 10
    assert [r.input_len for r in fixed] == [17] * 10
    again = synthetic_requests(tok, 30, LengthRange(2, 40), LengthRange(3, 3), random.Random(5))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_too_few_single_token_words_is_refused():
    class Tiny:
        vocab_size = 3

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [0] * len(text)

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return " ab"

    with pytest.raises(ValueError, match="use --dataset random"):
        single_token_words(Tiny())


def test_random_token_prompts_avoid_special_tokens(tok):
    specials = special_token_ids(tok)
    assert {0, 1} <= specials
    reqs = random_token_requests(
        tok.vocab_size, 20, LengthRange(50, 50), LengthRange(1, 8), random.Random(1), exclude=specials
    )
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.input_len == 50
        assert all(0 <= i < tok.vocab_size and i not in specials for i in r.prompt)
        assert 1 <= r.output_len <= 8


def _sharegpt_file(tmp_path, entries):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(entries))
    return path


def _conv(prompt: str, reply: str) -> dict:
    return {"id": "x", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def test_sharegpt_reads_prompts_and_reply_lengths(tmp_path, tok):
    entries = [
        _conv("kaka lolo mimi", "nene popo"),
        {"conversations": [{"from": "human", "value": "only one turn"}]},  # skipped
        _conv("", "empty prompt"),  # skipped
        _conv("rusa tivo", "zeze braglu kaka lolo"),
        "not a conversation",  # skipped
    ]
    path = _sharegpt_file(tmp_path, entries)
    reqs = sharegpt_requests(path, 2, random.Random(0), tok=tok, output_len=None)
    by_prompt = {r.prompt: r for r in reqs}
    assert set(by_prompt) == {"kaka lolo mimi", "rusa tivo"}
    first = by_prompt["kaka lolo mimi"]
    assert first.input_len == len(tok.encode("kaka lolo mimi"))
    assert first.output_len == len(tok.encode("nene popo", add_special_tokens=False))
    with pytest.raises(ValueError, match="2 usable conversations, fewer than --num-prompts 3"):
        sharegpt_requests(path, 3, random.Random(0), tok=tok, output_len=None)


def test_sharegpt_without_tokenizer_needs_output_len(tmp_path):
    path = _sharegpt_file(tmp_path, [_conv("a b c", "d e")])
    with pytest.raises(ValueError, match="--output-len"):
        sharegpt_requests(path, 1, random.Random(0), tok=None, output_len=None)
    (r,) = sharegpt_requests(path, 1, random.Random(0), tok=None, output_len=LengthRange(7, 7))
    assert r.input_len is None and r.output_len == 7


def test_sharegpt_max_model_len_and_bad_files(tmp_path, tok):
    path = _sharegpt_file(tmp_path, [_conv("kaka " * 30, "lolo"), _conv("mimi", "nene")])
    (r,) = sharegpt_requests(path, 1, random.Random(0), tok=tok, output_len=None, max_model_len=10)
    assert r.prompt == "mimi"
    with pytest.raises(FileNotFoundError):
        sharegpt_requests(tmp_path / "missing.json", 1, random.Random(0), tok=tok, output_len=None)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        sharegpt_requests(tmp_path / "bad.json", 1, random.Random(0), tok=tok, output_len=None)
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(tmp_path / "obj.json", 1, random.Random(0), tok=tok, output_len=None)


def test_build_requests_dispatch_and_refusals(tok):
    common = dict(seed=3, input_len=LengthRange(6, 6), output_len=LengthRange(2, 2))
    syn = build_requests(DatasetSpec("synthetic"), 4, tokenizer=tok, **common)
    assert [r.input_len for r in syn] == [6] * 4
    rnd = build_requests(DatasetSpec("random"), 4, tokenizer=None, vocab_size=100, **common)
    assert all(len(r.prompt) == 6 and max(r.prompt) < 100 for r in rnd)
    assert build_requests(DatasetSpec("random"), 4, tokenizer=None, vocab_size=100, **common) == rnd
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_requests(DatasetSpec("synthetic"), 1, tokenizer=None, **common)
    with pytest.raises(ValueError, match="--vocab-size"):
        build_requests(DatasetSpec("random"), 1, tokenizer=None, **common)
    with pytest.raises(ValueError, match="--num-prompts"):
        build_requests(DatasetSpec("random"), 0, tokenizer=tok, **common)

"""Tokenizer (from GGUF metadata and from HF files), chat templates, and incremental detokenization.

The SmolLM2 tokenizer is checked against transformers' GGUF tokenizer on a varied corpus. One
deliberate difference: SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split
every digit off before GPT-2's regex; transformers' GGUF path skips that step, which changes how a
run of spaces before a digit is cut. We follow the model (see test_digits_split_like_smollm2).
"""

from __future__ import annotations

import json
import re

import pytest

from blink_appliance.model.detokenizer import IncrementalDetokenizer
from blink_appliance.model.tokenizer import ChatTemplateError, Tokenizer
from tests.gguf_helpers import write_gguf

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "Numbers: 3.14159, 1,000,000 and 42nd; 2024-06-01T12:00:00Z",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "combining: e\u0301 a\u0308 n\u0303 — Zalgo: Z\u0351\u0363a\u0346l\u0350g\u036ao",
    "whitespace:  two   three\t\ttabs\n\n\nnewlines \r\n crlf   ",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after special<repo_name>x<file_sep>",
    "Ünïcödé àccents, ß, Ωmega, ∑∫√",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "",
    "'s 're 've I'm you'll they'd DON'T",
    "مرحبا بالعالم — Привет, мир — γειά σου κόσμε",
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(smollm2_gguf_path)
    theirs = transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name
    )
    return ours, theirs


@pytest.mark.slow
def test_smollm2_encode_decode_equal_transformers(smol):
    ours, theirs = smol
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_ids == (theirs.eos_token_id,)
    for text in CORPUS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), text
        assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips
    assert ours.encode("<|im_start|>") == [1]  # control tokens stay whole


@pytest.mark.slow
def test_digits_split_like_smollm2(smol):
    ours, theirs = smol
    # Digits are always single tokens (no digit merges exist in this vocabulary), so the two agree
    # except where whitespace before a digit is cut: SmolLM2 keeps the run "  " whole (one token).
    assert ours.encode("x 1234 y") == theirs.encode("x 1234 y")
    ids = ours.encode("a  12")
    assert [ours.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1", "2"]
    assert [theirs.convert_ids_to_tokens(i) for i in theirs.encode("a  12")] == ["a", "Ġ", "Ġ", "1", "2"]
    assert ours.decode(ids) == theirs.decode(theirs.encode("a  12")) == "a  12"
    # The same for any Unicode number (\p{N}): the space before "½" (bytes C2 BD) is cut off first.
    assert theirs.convert_ids_to_tokens(theirs.encode(" ½")) == ["ĠÂ", "½"]
    assert [ours.id_to_token(i) for i in ours.encode(" ½")] == ["Ġ", "Â½"]
    for text in ("½ ¾, ① ②", "x  1 \t 2"):
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_smollm2_chat_template_equals_transformers(smol):
    ours, theirs = smol
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Tell me a joke."},
            {"role": "assistant", "content": "Why did the chicken cross the road?"},
            {"role": "user", "content": "Why? 🐔"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    prompt = ours.apply_chat_template(conversations[0])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ours.encode(prompt, add_special_tokens=False)[0] == 1


@pytest.mark.slow
def test_from_hf_dir_equals_transformers(smol, tmp_path):
    ours_gguf, theirs = smol
    theirs.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.vocab_size == ours_gguf.vocab_size
    assert ours.bos_token_id == 1 and 2 in ours.eos_token_ids
    for text in CORPUS:
        assert ours.encode(text) == theirs.encode(text), text
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


# ---- incremental detokenization ---------------------------------------------------------------


@pytest.mark.slow
def test_detokenizer_deltas_concatenate_to_full_decode(smol):
    tok, _ = smol
    for text in CORPUS + ["".join(CORPUS)]:
        ids = tok.encode(text, add_special_tokens=False)
        for prompt in (None, tok.encode("Prompt text before:", add_special_tokens=False)):
            detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
            deltas = [detok.feed(i) for i in ids] + [detok.flush()]
            assert "".join(deltas) == tok.decode(ids), text
            assert not any("\ufffd" in d for d in deltas), text


@pytest.mark.slow
def test_held_tokens_decode_at_once_to_what_fed_tokens_give(smol):
    """hold (a whole response's tokens) then flush gives the text feed-by-token gives, also for a
    sequence cut mid-character and after a prompt, with some tokens fed after held ones."""
    tok, _ = smol
    cut = tok.encode("🎉", add_special_tokens=False)[:-1]
    for text in CORPUS + ["".join(CORPUS)]:
        for ids in (
            tok.encode(text, add_special_tokens=False),
            tok.encode(text, add_special_tokens=False) + cut,
        ):
            for prompt in (None, tok.encode("Prompt text before:", add_special_tokens=False)):
                fed = IncrementalDetokenizer(tok, prompt_ids=prompt)
                expected = "".join([fed.feed(i) for i in ids] + [fed.flush()])
                held = IncrementalDetokenizer(tok, prompt_ids=prompt)
                assert [held.hold(i) for i in ids] == [""] * len(ids)
                assert held.flush() == expected, text
                mixed = IncrementalDetokenizer(tok, prompt_ids=prompt)
                half = len(ids) // 2
                parts = [mixed.hold(i) for i in ids[:half]] + [mixed.feed(i) for i in ids[half:]]
                assert "".join(parts + [mixed.flush()]) == expected, text


@pytest.mark.slow
def test_detokenizer_holds_back_partial_characters(smol):
    tok, _ = smol
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # one emoji, several byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1]) == "🎉"
    # A sequence cut off mid-character: nothing leaks early, and flush gives what a full decode gives.
    detok = IncrementalDetokenizer(tok)
    partial = ids[:-1] + tok.encode(" ok", add_special_tokens=False)
    out = [detok.feed(i) for i in ids[:-1]]
    assert out == [""] * len(out)
    assert "".join(out + [detok.feed(i) for i in partial[len(ids) - 1 :]] + [detok.flush()]) == tok.decode(
        partial
    )
    cut = IncrementalDetokenizer(tok)
    assert "".join(cut.feed(i) for i in ids[:-1]) == ""
    assert cut.flush() == tok.decode(ids[:-1])  # U+FFFD, as the full decode


@pytest.mark.slow
def test_detokenizer_skips_special_tokens_unless_asked(smol):
    tok, _ = smol
    ids = tok.encode("<|im_start|>assistant\nHello<|im_end|>", add_special_tokens=False)
    plain = IncrementalDetokenizer(tok)
    assert "".join([plain.feed(i) for i in ids] + [plain.flush()]) == "assistant\nHello"
    raw = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join([raw.feed(i) for i in ids] + [raw.flush()]) == "<|im_start|>assistant\nHello<|im_end|>"


# ---- synthetic GGUF tokenizers (fast) -----------------------------------------------------------


def _tiny(tmp_path, **kw) -> Tokenizer:
    path = tmp_path / "t.gguf"
    write_gguf(path, hidden=64, head_dim=16, ff=64, **kw)
    return Tokenizer.from_gguf(path)


def test_tiny_gguf_tokenizer_merges_specials_and_bos(tmp_path):
    tok = _tiny(tmp_path, add_bos=True)
    ids = tok.encode("hello the")
    assert ids[0] == tok.bos_token_id == tok.token_to_id("<|im_start|>")
    assert [tok.id_to_token(i) for i in ids[1:]] == ["hello", "Ġthe"]
    assert tok.encode("hello the", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "hello the"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello the"
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert tok.encode("a<|im_end|>b", add_special_tokens=False) == [
        tok.token_to_id("a"),
        tok.eos_token_ids[0],
        tok.token_to_id("b"),
    ]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "ĠĠ", "Ġy"]),
        ("gpt2", ["x", "Ġ12345", "ĠĠ", "Ġy"]),
        ("llama-bpe", ["x", "Ġ", "123", "45", "ĠĠ", "Ġy"]),
        ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "ĠĠ", "Ġy"]),
    ],
)
def test_pre_tokenizers_split_like_llama_cpp(tmp_path, pre, pieces):
    tok = _tiny(tmp_path, pre=pre)
    got = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12345   y")]
    assert got == pieces


def test_unsupported_tokenizer_model_and_pre_are_named(tmp_path):
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        _tiny(tmp_path, tokenizer_model="llama")
    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-coder' is not supported"):
        _tiny(tmp_path, pre="deepseek-coder")


def test_chat_template_errors_and_helpers(tmp_path):
    tok = _tiny(tmp_path)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

    strict = Tokenizer(
        tok.backend,
        bos_token_id=None,
        eos_token_ids=(),
        chat_template=(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
            "{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ custom }}"
        ),
    )
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    out = strict.apply_chat_template([{"role": "user", "content": "é"}], custom="kw")
    year, js, kw = out.split("|")
    assert re.fullmatch(r"\d{4}", year) and json.loads(js) == [{"role": "user", "content": "é"}] and "é" in js
    assert kw == "kw"
    sandboxed = Tokenizer(
        tok.backend, bos_token_id=None, eos_token_ids=(), chat_template="{{ messages.__class__.__mro__ }}"
    )
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template([])


def test_from_hf_dir_reads_config_and_generation_eos(tmp_path):
    src = _tiny(tmp_path)
    d = tmp_path / "hf"
    d.mkdir()
    src.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|im_end|>",
                "add_bos_token": True,
                "chat_template": [
                    {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}
                ],
            }
        )
    )
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [src.token_to_id("<|endoftext|>")]})
    )
    tok = Tokenizer.from_hf_dir(d)
    assert tok.bos_token_id == src.token_to_id("<|im_start|>")
    assert tok.eos_token_ids == (src.token_to_id("<|im_end|>"), src.token_to_id("<|endoftext|>"))
    assert (
        tok.encode("hello")[0] == tok.bos_token_id
    )  # add_bos_token with no post-processor in tokenizer.json
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")

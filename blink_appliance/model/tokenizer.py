"""Text <-> token ids, and chat templates: a `tokenizers.Tokenizer` plus the few facts around it.

Built from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or rebuilt from a
GGUF file's metadata (byte-level BPE: vocab, merges, token types, the pre-tokenizer named by
`tokenizer.ggml.pre`). Chat templates are Jinja2, rendered in a sandbox the way transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from blink_appliance.model.gguf_file import field_value, open_gguf

if TYPE_CHECKING:
    import jinja2
    from gguf import GGUFReader

# GGUF token_type values (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4
_GIL_FREE_CHARS = 4096  # longer texts are encoded through encode_batch (see Tokenizer.encode)

# Pre-tokenizer splits, by `tokenizer.ggml.pre`: the regexes llama.cpp uses for each, which are
# also what the models' own tokenizer.json files do.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder vocabularies: every digit on its own, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level_gpt2()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# name -> (pre-tokenizer factory, NFC-normalize?, BPE ignore_merges?)
_GGUF_PRE_TOKENIZERS: dict[str, tuple[Any, bool, bool]] = {
    "default": (_byte_level_gpt2, False, False),
    "gpt-2": (_byte_level_gpt2, False, False),
    "gpt2": (_byte_level_gpt2, False, False),
    "smollm": (_digits_then_gpt2, False, False),
    "starcoder": (_digits_then_gpt2, False, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
    "llama-v3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), True, False),
}


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the conversation."""


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self._compiled: tuple[str, jinja2.Template] | None = None  # (source, template), compiled on first use

    # -- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # encode_batch releases the GIL while it works (encode does not): a worker thread
            # tokenizing a long prompt then leaves the event loop free. The same ids.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The conversation as the model's prompt text (encode it with add_special_tokens=False)."""
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return self._template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2 errors, or the template indexing a message wrongly
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a plain completion prompt")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _compile_chat_template(self.chat_template))
        return self._compiled[1]

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json / chat_template.jinja / generation_config.json if present."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found")
        backend = tokenizers.Tokenizer.from_file(str(path))
        cfg = _read_json(directory / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        bos = token_id("bos_token")
        eos: list[int] = [] if (e := token_id("eos_token")) is None else [e]
        gen_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        if cfg.get("add_bos_token") and bos is not None and backend.post_processor is None:
            backend.post_processor = _bos_processor(backend.id_to_token(bos), bos)
        return cls(backend, bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)), chat_template=template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_reader(open_gguf(path))

    @classmethod
    def from_gguf_reader(cls, reader: GGUFReader) -> Tokenizer:
        def meta(key: str, default: Any = None) -> Any:
            return field_value(reader, f"tokenizer.ggml.{key}", default)

        model = meta("model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2', byte-level BPE)"
            )
        pre = meta("pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_GGUF_PRE_TOKENIZERS)})"
            )
        make_pre, nfc, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
        tokens: list[str] = meta("tokens")
        merges: list[str] | None = meta("merges")
        if not tokens or merges is None:
            raise ValueError("GGUF tokenizer: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        types: list[int] = meta("token_type") or [1] * len(tokens)

        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
        if nfc:
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = make_pre()
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )

        bos = meta("bos_token_id")
        if meta("add_bos_token", False) and bos is not None:
            backend.post_processor = _bos_processor(tokens[int(bos)], int(bos))
        eos = tuple(
            dict.fromkeys(
                int(v) for k in ("eos_token_id", "eot_token_id", "eom_token_id") if (v := meta(k)) is not None
            )
        )
        return cls(
            backend,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos,
            chat_template=field_value(reader, "tokenizer.chat_template"),
        )


def _bos_processor(bos: str, bos_id: int) -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile as transformers does: sandboxed, trim/lstrip blocks, loop controls, raise_exception, strftime_now."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template: {message}")

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e

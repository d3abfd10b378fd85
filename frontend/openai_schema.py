"""OpenAI request bodies (pydantic) and response bodies for /v1/completions and /v1/chat/completions.

Unknown keys are refused (400 naming the key) rather than ignored; keys OpenAI defines but this
appliance does not implement are accepted by the schema only so `unsupported()` can refuse them
with "not supported yet" when they ask for something other than the default behaviour.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from blink_appliance.frontend.errors import APIError, bad_request, not_supported
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blink_appliance.wire.request import MAX_LOGIT_BIAS, MAX_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_STOP_STRING_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 and 0 both disable it (vLLM uses -1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # Choices: n engine requests of the prompt, each its own seed stream (seed + i when seeded).
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own bookkeeping; no effect on output
    # vLLM's extension: lower runs first. The appliance runs a request at the larger (later) of this
    # and its base class (its API key's, else the model's): a request may lower itself, never raise.
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)

    # Penalties (OpenAI's two, vLLM's repetition) and logit_bias (token id as a string -> bias).
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # Structured output (frontend/structured_output.py): OpenAI's, and vLLM's guided_* extensions.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_ok(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in stops:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> APIError | None:
        """The first parameter this appliance cannot honour yet, as a 400, or None."""
        if self.stream_options is not None and not self.stream:
            return bad_request("stream_options is only allowed when stream is true", "stream_options")
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            return bad_request(
                f"logit_bias has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS}", "logit_bias"
            )
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                return bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                return bad_request(
                    f"logit_bias for token {key} must be in [-100, 100], got {bias}", "logit_bias"
                )
        return None

    @property
    def top_n(self) -> int | None:
        """How many alternatives per position the request wants logprobs for (None: no logprobs)."""
        return None

    @property
    def echoes(self) -> bool:
        return False


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: the prompt's logprobs, nothing generated (OpenAI's legacy scoring request).
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    top_logprobs: Any = None  # chat's parameter: refused here, naming the one to use
    best_of: Any = None
    suffix: Any = None

    @property
    def top_n(self) -> int | None:
        return self.logprobs

    @property
    def echoes(self) -> bool:
        return bool(self.echo)

    def unsupported(self) -> APIError | None:
        if self.top_logprobs is not None:
            return bad_request(
                "top_logprobs is a chat completions parameter; /v1/completions takes logprobs: N",
                "top_logprobs",
            )
        if self.max_tokens == 0 and not self.echo:
            return bad_request("max_tokens=0 needs echo=true (it returns only the prompt)", "max_tokens")
        if self.best_of not in (None, 1):
            return not_supported("best_of")
        if self.suffix not in (None, ""):
            return not_supported("suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                return bad_request(
                    "batched prompts are not supported yet: send one prompt per request", "prompt"
                )
        return super().unsupported()

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An OpenAI content part other than text: accepted by the schema only so that
    ChatCompletionRequest.unsupported() refuses it with "not supported yet"."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


# Served roles ("tool": a tool's result, answering an assistant message's tool_calls), and the
# legacy "function" role (refused in unsupported()).
SERVED_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Annotated[TextPart | MediaPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    # Tool calling's message fields (function_call, the legacy form, is refused as such).
    tool_call_id: Any = None
    tool_calls: Any = None
    function_call: Any = None

    def unsupported(self, index: int) -> APIError | None:
        where = f"messages[{index}]"
        if self.role not in SERVED_ROLES:
            return _message_refused(
                f"{where}: '{self.role}' messages are not supported yet (legacy function calling)"
            )
        if self.function_call is not None:
            return _message_refused(f"{where}.function_call is not supported yet (legacy function calling)")
        if self.tool_calls not in (None, []) and self.role != "assistant":
            return bad_request(f"{where}: only assistant messages carry tool_calls", "messages")
        if self.content is None and self.role == "assistant" and self.tool_calls:
            return None  # a call's message may have no text
        if self.content is None:
            return bad_request(
                f"missing required parameter 'messages.{index}.content'", "messages", "missing_parameter"
            )
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if isinstance(part, MediaPart):
                    return _message_refused(
                        f"{where}.content[{j}]: '{part.type}' content parts are not supported yet "
                        "(only text parts)"
                    )
        return None

    @property
    def text(self) -> str:
        """Its text; an assistant's tool calls without text are written as their JSON (a chat
        template that knows no tools still shows the model what it called)."""
        if self.content is None and self.tool_calls:
            return json.dumps([c.get("function", c) for c in self.tool_calls], ensure_ascii=False)
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or () if isinstance(part, TextPart))


def _message_refused(message: str) -> APIError:
    return APIError(400, message, param="messages", code="unsupported_parameter")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None

    def unsupported(self) -> APIError | None:
        if self.functions not in (None, []):
            return not_supported("functions", "legacy function calling; use tools")
        if self.function_call not in (None, "none"):
            return not_supported("function_call", "legacy function calling; use tool_choice")
        if self.parallel_tool_calls not in (None, False):
            return not_supported("parallel_tool_calls", "tool calling")
        for i, message in enumerate(self.messages):
            if (problem := message.unsupported(i)) is not None:
                return problem
        if self.top_logprobs is not None and not self.logprobs:
            return bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return super().unsupported()

    @property
    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: role and text."""
    # "developer" is OpenAI's newer name for the system role; chat templates know "system".
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def parse_request(cls: type[RequestT], body: Any) -> RequestT:
    """Validate a JSON body; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        # Strict: JSON's own types only, as OpenAI checks them ("5", 3.0 or true for an integer,
        # "yes" for a boolean are 400s, not coerced).
        request = cls.model_validate(body, strict=True)
    except ValidationError as e:
        errors = e.errors()
        # A bad content part fails every branch of `str | list[part]`: of the first parameter's
        # errors, the deepest is the branch the input meant (the part), not "should be a string".
        first = errors[0]["loc"][:1]
        err = max((x for x in errors if x["loc"][:1] == first), key=lambda x: len(x["loc"]))
        loc = [str(p) for p in err["loc"] if not _is_branch_label(p)]
        where = ".".join(loc)
        param = loc[0] if loc else None  # OpenAI names the top-level parameter
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter '{where}'", param, "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required parameter '{where}'", param, "missing_parameter") from None
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise bad_request(f"invalid '{where}': {msg}", param, "invalid_value") from None
    problem = request.unsupported()
    if problem is not None:
        raise problem
    return request


def _is_branch_label(part: int | str) -> bool:
    """pydantic's names for the branch of a union in an error's location ("str", "list[...]")."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none"))


# -- responses --------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, int] | None,
    created: int,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    body["usage"] = usage_
    return body


def chat_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, int] | None,
    created: int,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }


def _chunk(
    rid: str,
    kind: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, int] | None,
) -> dict[str, Any]:
    """One streamed event; usage only where it is sent (the last chunk, if the client asked)."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    *,
    delta: dict[str, str] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choices = (
        []
        if delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    return _chunk(rid, "chat.completion.chunk", model, created, choices, usage_)


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    *,
    text: str | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choices = (
        []
        if text is None
        else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    return _chunk(rid, "text_completion", model, created, choices, usage_)


def models_body(models: Sequence[str], created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": created, "owned_by": "blink"} for m in models],
    }


def now_s() -> int:
    return int(time.time())

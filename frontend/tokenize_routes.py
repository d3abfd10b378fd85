"""vLLM's /tokenize and /detokenize: the ids a prompt becomes, through the same tokenizer and chat
template the model's completions use, and the text ids decode to. Both take `model` (optional when
one model is served) and sit behind the API key like /v1/*."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from blink_appliance.frontend.completion_service import CompletionService
from blink_appliance.frontend.errors import bad_request
from blink_appliance.frontend.handlers import MODELS, json_body
from blink_appliance.frontend.openai_schema import ChatMessage, template_messages
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _TokenizeBase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    return_token_strs: bool = False


class TokenizeCompletion(_TokenizeBase):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_TokenizeBase):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def tokenize(request: web.Request) -> web.Response:
    body = await json_body(request)
    kind = TokenizeChat if isinstance(body, dict) and "messages" in body else TokenizeCompletion
    req = _parse(kind, body)
    service = _service(request, req.model)
    if isinstance(req, TokenizeChat):
        for i, message in enumerate(req.messages):
            if (problem := message.unsupported(i)) is not None:
                raise problem
        ids = await service.chat_prompt_ids(
            template_messages(req.messages),
            add_generation_prompt=req.add_generation_prompt,
            add_special_tokens=req.add_special_tokens,
        )
    else:
        ids = await service.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [_token_str(service.tokenizer, t) for t in ids]
    return web.json_response(
        {"count": len(ids), "max_model_len": service.limits.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    req = _parse(Detokenize, await json_body(request))
    service = _service(request, req.model)
    vocab = service.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return web.json_response({"prompt": service.tokenizer.decode(req.tokens, skip_special_tokens=False)})


def _service(request: web.Request, model: str | None) -> CompletionService:
    router = request.app[MODELS]
    if model is None:
        if len(router.names) != 1:
            raise bad_request(
                f"missing required parameter 'model' (this appliance serves {len(router.names)} models)",
                "model",
                "missing_parameter",
            )
        model = router.names[0]
    return router.service_for(model)


def _parse(kind: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return kind.model_validate(body, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter '{where}'", param, "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required parameter '{where}'", param, "missing_parameter") from None
        raise bad_request(f"invalid '{where}': {err['msg']}", param, "invalid_value") from None


def _token_str(tokenizer: Any, token_id: int) -> str:
    """The vocabulary's own string for the id (byte-level pieces as the tokenizer spells them)."""
    piece = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    return piece if piece is not None else tokenizer.decode([token_id], skip_special_tokens=False)

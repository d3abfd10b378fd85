"""Thin aiohttp handlers: parse the body, ask the CompletionService, write JSON or SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from aiohttp import web
from blink_appliance.frontend.auth import KEY_PRIORITY
from blink_appliance.frontend.completion_service import CompletionService, EngineFailure, Piece
from blink_appliance.frontend.errors import APIError, bad_request
from blink_appliance.frontend.logprobs import LogprobEntry, chat_logprobs, completion_logprobs
from blink_appliance.frontend.metrics import CONTENT_TYPE
from blink_appliance.frontend.model_router import ModelRouter
from blink_appliance.frontend.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    models_body,
    now_s,
    parse_request,
    usage,
)
from blink_appliance.frontend.prepared import Prepared
from blink_appliance.frontend.tool_calls import ToolCallReplies

log = logging.getLogger(__name__)

MODELS = web.AppKey("models", ModelRouter)
STARTED_AT = web.AppKey("started_at", int)
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# A JSON escape of a UTF-16 surrogate: only a body holding one needs its strings checked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def json_body(request: web.Request) -> Any:
    limit = request.app[BODY_TIMEOUT_S]
    try:  # over client_max_size: aiohttp raises 413, the error middleware shapes it
        raw = await asyncio.wait_for(request.read(), limit)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {limit:g} s", code="request_timeout"
        ) from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: Any) -> None:
    """json.loads turns an unpaired \\ud800 into a str that no tokenizer can take: a 400 here."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(
                    "the request body holds an unpaired UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode"
                ) from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _failure(e: EngineFailure) -> APIError:
    return APIError(503, e.message, type="server_error", code="engine_failure", headers={"Retry-After": "1"})


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic_ns()
    req = parse_request(CompletionRequest, await json_body(request))
    service = request.app[MODELS].service_for(req.model)
    prep = await service.prepare_completion(req, request.get(KEY_PRIORITY))
    prep.arrived_ns = arrived
    model = service.limits.model_name
    created = now_s()

    def logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any] | None:
        return None if prep.top_n is None else completion_logprobs(entries, service.token_strings)

    def chunk(index: int, text: str | None, reason: str | None = None, use: dict[str, int] | None = None,
              entries: Sequence[LogprobEntry] = ()) -> dict[str, Any]:  # fmt: skip
        lp = logprobs(entries)
        return completion_chunk(
            prep.rid, model, created, text=text, finish_reason=reason, usage_=use, logprobs=lp, index=index
        )

    def whole(index: int, text: str, reason: str | None, entries: Sequence[LogprobEntry]) -> dict[str, Any]:
        return completion_body(prep.rid, model, text, reason, None, created, logprobs(entries), index=index)

    return await _respond(request, service, prep, req.n, chunk, whole)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic_ns()
    req = parse_request(ChatCompletionRequest, await json_body(request))
    service = request.app[MODELS].service_for(req.model)
    prep = await service.prepare_chat(req, request.get(KEY_PRIORITY))
    prep.arrived_ns = arrived
    model = service.limits.model_name
    created = now_s()
    opened: set[int] = set()  # choices whose stream has sent its role

    def logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any] | None:
        return None if prep.top_n is None else chat_logprobs(entries, service.token_strings)

    calls = ToolCallReplies(prep.tool_mode)

    def chunk(index: int, text: str | None, reason: str | None = None, use: dict[str, int] | None = None,
              entries: Sequence[LogprobEntry] = ()) -> dict[str, Any]:  # fmt: skip
        if text is None:
            delta = None
        elif index not in opened:  # OpenAI opens each choice's stream with the role
            delta = {"role": "assistant", "content": text}
            opened.add(index)
        elif calls.mode is not None:  # held until the call is whole, then sent as tool_calls
            delta, reason = calls.delta(index, text, reason)
        else:
            delta = {"content": text} if text or reason is None else {}
        lp = logprobs(entries) if entries else None
        return chat_chunk(
            prep.rid, model, created, delta=delta, finish_reason=reason, usage_=use, logprobs=lp, index=index
        )

    def whole(index: int, text: str, reason: str | None, entries: Sequence[LogprobEntry]) -> dict[str, Any]:
        body = chat_body(prep.rid, model, text, reason, None, created, logprobs(entries), index=index)
        return calls.whole(body, text, reason)

    return await _respond(request, service, prep, req.n, chunk, whole)


async def _respond(
    request: web.Request,
    service: CompletionService,
    prep: Prepared,
    n: int,
    chunk: Callable[..., dict[str, Any]],
    whole: Callable[[int, str, str | None, Sequence[LogprobEntry]], dict[str, Any]],
) -> web.StreamResponse:
    """n choices: n engine requests of the same prompt (each its own seed stream, Prepared.choice)."""
    preps = [prep, *(prep.choice(i) for i in range(1, n))]

    def use() -> dict[str, int]:
        return usage(prep.prompt_tokens, sum(p.completion_tokens for p in preps))

    async with contextlib.AsyncExitStack() as stack:
        pieces = [await stack.enter_async_context(contextlib.aclosing(service.generate(p))) for p in preps]
        await anext(pieces[0])  # admission (APIError 400/503 while a status can still be sent; leaving
        if n > 1 and service.limits.shares_prefixes:  # closes the ones admitted, which cancels them)
            # The other choices go in once the first one's prompt is computed: they share its blocks.
            pieces[0] = await stack.enter_async_context(
                contextlib.aclosing(await _after_first_piece(pieces[0]))
            )
        for choice in pieces[1:]:
            await anext(choice)
        if not prep.stream:
            return await _whole_response(pieces, whole, use)
        return await _stream_response(request, prep, pieces, chunk, use)


async def _after_first_piece(choice: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """Wait for a choice's first piece (its prompt is then computed, and its full blocks are in
    the engine's prefix cache), and give back the choice with that piece still to come."""
    try:
        first = await anext(choice, None)
    except EngineFailure as e:
        raise _failure(e) from None

    async def replay() -> AsyncIterator[Piece]:
        if first is not None:
            yield first
        async for piece in choice:
            yield piece

    return replay()


async def _whole_response(
    pieces: list[AsyncIterator[Piece]],
    whole: Callable[[int, str, str | None, Sequence[LogprobEntry]], dict[str, Any]],
    use: Callable[[], dict[str, int]],
) -> web.Response:
    texts: list[list[str]] = [[] for _ in pieces]
    entries: list[list[LogprobEntry]] = [[] for _ in pieces]
    reasons: list[str | None] = [None for _ in pieces]
    try:
        async with contextlib.aclosing(_merged(pieces)) as merged:  # a failure cancels the other choices
            async for index, piece in merged:
                texts[index].append(piece.text)
                entries[index].extend(piece.logprobs)
                reasons[index] = piece.finish_reason
    except EngineFailure as e:
        raise _failure(e) from None
    choices = [whole(i, "".join(texts[i]), reasons[i], entries[i])["choices"][0] for i in range(len(pieces))]
    return web.json_response(whole(0, "", None, ()) | {"choices": choices, "usage": use()})


async def _merged(pieces: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """The choices' pieces as they come, each with its choice's index (one choice: no tasks)."""
    if len(pieces) == 1:
        async for piece in pieces[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, choice: AsyncIterator[Piece]) -> None:
        try:
            async for piece in choice:
                await queue.put((index, piece))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 (handed to the stream, which ends with it)
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, choice)) for i, choice in enumerate(pieces)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream_response(
    request: web.Request,
    prep: Prepared,
    pieces: list[AsyncIterator[Piece]],
    chunk: Callable[..., dict[str, Any]],
    use: Callable[[], dict[str, int]],
) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)

    async def send(obj: dict[str, Any] | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await response.write(f"data: {data}\n\n".encode())

    ending: list[dict[str, Any] | str] = []
    try:
        for index in range(len(pieces)):
            await send(chunk(index, ""))  # the role chunk for chat; an empty text chunk for completions
        if len(pieces) == 1:  # one choice (the common case): no merging on the per-token path
            async for piece in pieces[0]:
                if piece.text or piece.finish_reason is not None or piece.logprobs:
                    await send(chunk(0, piece.text, piece.finish_reason, entries=piece.logprobs))
        else:
            async with contextlib.aclosing(_merged(pieces)) as merged:
                async for index, piece in merged:
                    if piece.text or piece.finish_reason is not None or piece.logprobs:
                        await send(chunk(index, piece.text, piece.finish_reason, entries=piece.logprobs))
        if prep.include_usage:
            await send(chunk(0, None, use=use()))
        await send("[DONE]")
    except EngineFailure as e:
        ending = [_failure(e).body(), "[DONE]"]  # the status is already sent: the error goes in the stream
    except ConnectionResetError:  # the client went away: closing `pieces` cancels the request
        log.debug("client disconnected from %s", prep.rid)
        return response
    except Exception:  # a 200 is already sent: the stream must still end, with the error in it
        log.exception("stream %s failed", prep.rid)
        error = APIError(500, "the server failed while streaming this request", type="server_error")
        ending = [error.body(), "[DONE]"]
    try:
        for obj in ending:
            await send(obj)
        await response.write_eof()
    except ConnectionResetError:  # gone before its stream's end could reach it
        log.debug("client disconnected from %s before its stream ended", prep.rid)
    return response


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(models_body(request.app[MODELS].names, request.app[STARTED_AT]))


async def get_model(request: web.Request) -> web.Response:
    name = request.app[MODELS].service_for(request.match_info["model"]).limits.model_name
    return web.json_response(models_body([name], request.app[STARTED_AT])["data"][0])


async def health(request: web.Request) -> web.Response:
    """200 only while every model's engine is alive; `models` says which one is not. With one
    model the body also keeps its `model` key, as before there were several."""
    router = request.app[MODELS]
    models = router.health()
    if router.draining:
        status, code = "draining", 503
    elif any(m.status != "ok" for m in models):
        status, code = "engine_unavailable", 503
    else:
        status, code = "ok", 200
    body: dict[str, Any] = {"status": status}
    if len(models) == 1:
        body["model"] = models[0].name
    body["inflight"] = router.inflight
    body["models"] = [{"name": m.name, "status": m.status, "inflight": m.inflight} for m in models]
    return web.json_response(body, status=code)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[MODELS].metrics.render(), headers={"Content-Type": CONTENT_TYPE})

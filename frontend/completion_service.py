"""One request's way through the front end: tokenize -> validate -> submit -> stream -> detokenize -> stop strings.

The service knows nothing about HTTP (handlers.py turns its pieces into JSON or SSE); it talks to
the engine only through the ring client. Every admitted request ends in exactly one terminal piece
(a finish reason) or one EngineFailure; leaving `generate` early cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from blink_appliance.frontend.errors import APIError, bad_request, service_unavailable
from blink_appliance.frontend.logprobs import ChoiceLogprobs, LogprobEntry, TokenStrings
from blink_appliance.frontend.metrics import ServingMetrics
from blink_appliance.frontend.openai_schema import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from blink_appliance.frontend.prepared import Prepared, effective_priority
from blink_appliance.frontend.stop_strings import StopStringMatcher
from blink_appliance.frontend.tool_calls import tool_mode
from blink_appliance.frontend.turns import Turns

from blink_appliance.wire.client import EngineBusyError, EngineDeadError
from blink_appliance.wire.request import FinishReason, OutputEvent, SamplingParams, TokenRun

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
T = TypeVar("T")
_TOKENIZE_IN_THREAD_CHARS = 8192  # longer prompts are templated and tokenized off the event loop


class EngineClientLike(Protocol):
    """What the service needs from the ring client (blink_appliance.wire)."""

    @property
    def engine_alive(self) -> bool: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> Any: ...

    def stream_batches(self, request_id: int, whole: bool = False) -> AsyncIterator[list[OutputEvent]]: ...

    def abandon(self, request_id: int) -> None: ...

    def telemetry(self) -> dict[str, Any]: ...


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> Any: ...


@dataclass(frozen=True)
class ServiceLimits:
    model_name: str
    max_model_len: int
    max_prompt_tokens: int
    max_output_tokens: int
    max_stop_ids: int
    retry_after_s: int = 1
    # The model's priority class (`[[models]] priority`): a request's base when its key has none.
    default_priority: int = 0
    # Why this model's engine cannot give logprobs, or the prompt's (None: it can).
    logprobs_refusal: str | None = None
    # Why it cannot follow a structured-output constraint (None: CompletionService.constraints does).
    constraint_refusal: str | None = None
    # The engine caches prompt prefixes (the ring carries block hashes): n > 1 choices then submit
    # the first one alone and the rest once its prompt is computed, so they share its KV blocks.
    shares_prefixes: bool = False


@dataclass(frozen=True)
class Piece:
    """Text to send; the last piece of a request has `finish_reason` set."""

    text: str
    finish_reason: str | None = None
    logprobs: tuple[LogprobEntry, ...] = ()  # of the tokens (and echoed prompt) behind `text`


class EngineFailure(Exception):
    """The engine failed a request after it was admitted (crash, restart, internal error)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class _Inflight:
    count: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class CompletionService:
    def __init__(
        self,
        client: EngineClientLike,
        tokenizer: Any,
        detokenizer_factory: Any,
        limits: ServiceLimits,
        metrics: ServingMetrics,
        constraints: Any = None,
    ) -> None:
        self.client = client
        self.constraints = constraints  # a ConstraintCompiler (frontend/structured_output.py), or None
        self.tokenizer = tokenizer
        self._detokenizer_factory = detokenizer_factory
        self.limits = limits
        self.metrics = metrics
        self.token_strings = TokenStrings(tokenizer)  # logprobs' token texts and bytes
        self.draining = False
        self._inflight = _Inflight()
        self._turns = Turns()  # bursts of requests and whole responses' tokens take turns
        self._inflight.idle.set()

    # -- admission ----------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self._inflight.count

    async def wait_idle(self) -> None:
        await self._inflight.idle.wait()

    def check_model(self, model: str) -> None:
        if model != self.limits.model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this appliance serves '{self.limits.model_name}'",
                param="model",
                code="model_not_found",
            )

    async def prepare_completion(self, req: CompletionRequest, key_priority: int | None = None) -> Prepared:
        """`key_priority`: the class of the API key the request came with (None: none, or no keys)."""
        self.check_model(req.model)
        await self._turn(req, key_priority)
        prompt = req.single_prompt
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            ids = await self.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            self._check_ids(ids, "prompt")
        prep = self._prepared(
            req, ids, req.max_tokens, default_max=COMPLETIONS_DEFAULT_MAX_TOKENS, key_priority=key_priority,
            constraint=await self._constraint(req),
        )  # fmt: skip
        if req.echoes:
            prep.echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return prep

    async def prepare_chat(self, req: ChatCompletionRequest, key_priority: int | None = None) -> Prepared:
        self.check_model(req.model)
        await self._turn(req, key_priority)
        mode = tool_mode(req.tools, req.tool_choice)
        ids = await self.chat_prompt_ids(req.template_messages())
        constraint = await self._constraint(req, mode.schema if mode is not None else None)
        prep = self._prepared(
            req, ids, req.token_limit, default_max=None, key_priority=key_priority, constraint=constraint
        )
        prep.tool_mode = mode
        return prep

    async def _turn(self, req: _SamplingRequest, key_priority: int | None) -> None:
        """Wait for this request's class to have its turn (frontend/turns.py): a burst of requests
        (a batch job's clients all starting at once) is taken in one per event-loop iteration, more
        urgent classes first, instead of holding the loop until all of them are in."""
        base = self.limits.default_priority if key_priority is None else key_priority
        await self._turns.take(effective_priority(base, req.priority))

    async def _constraint(self, req: _SamplingRequest, tool_schema: Any = None) -> Any:
        """The request's structured-output automaton (compiled in a worker thread: a new schema takes
        up to a second or so), or None. `tool_schema`: what a tool call's reply must match."""
        from blink_appliance.frontend.structured_output import constraint_regex

        found = constraint_regex(req.response_format, req.guided_json, req.guided_regex, req.guided_choice)
        if tool_schema is not None:
            if found is not None:
                raise bad_request(
                    f"a tool call is already a constraint: {found[1]} cannot come with it", found[1]
                )
            try:
                found = (constraint_regex(None, tool_schema, None, None)[0], "tools")
            except APIError as e:
                raise bad_request(f"tools: {e.message}", "tools") from None
        if found is None:
            return None
        if self.constraints is None:
            raise bad_request(self.limits.constraint_refusal or "structured output is off", found[1])
        return await asyncio.to_thread(self.constraints.compile, *found)

    async def chat_prompt_ids(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The ids the model's chat template makes of `messages` (chat completions and /tokenize)."""
        try:
            templated = await self._off_loop_if_long(
                sum(len(str(m.get("content") or "")) for m in messages),
                self.tokenizer.apply_chat_template, messages, add_generation_prompt=add_generation_prompt,
            )  # fmt: skip
        except APIError:  # the tokenizer's own refusal (a model without a chat template)
            raise
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None
        if isinstance(templated, str):
            return await self.encode(templated, add_special_tokens=add_special_tokens)
        return list(templated)

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(
            await self._off_loop_if_long(
                len(text), self.tokenizer.encode, text, add_special_tokens=add_special_tokens
            )
        )

    @staticmethod
    async def _off_loop_if_long(chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Work that grows with the input (templating, tokenizing) runs in a worker thread once the
        input is long, so one big body does not stall every other stream's tokens."""
        if chars > _TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param)

    def _prepared(
        self,
        req: _SamplingRequest,
        ids: list[int],
        max_tokens: int | None,
        default_max: int | None,
        key_priority: int | None = None,
        constraint: Any = None,
    ) -> Prepared:
        lim = self.limits
        n = len(ids)
        if n > lim.max_prompt_tokens or n >= lim.max_model_len:
            raise bad_request(
                f"the prompt has {n} tokens; this model accepts at most "
                f"{min(lim.max_prompt_tokens, lim.max_model_len - 1)}",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                "context_length_exceeded",
            )
        if req.top_n is not None and lim.logprobs_refusal is not None:
            raise bad_request(lim.logprobs_refusal, "logprobs", "unsupported_parameter")
        score_only = max_tokens == 0  # the schema allows it only with echo
        if score_only:
            max_tokens = 1
        room = min(lim.max_model_len - n, lim.max_output_tokens)
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise bad_request(
                f"{param}={max_tokens} is too large: the prompt has {n} tokens, max_model_len is "
                f"{lim.max_model_len} and one request may generate at most {lim.max_output_tokens} tokens",
                param,
                "context_length_exceeded",
            )
        if len(req.stop_token_ids) > lim.max_stop_ids:
            raise bad_request(f"at most {lim.max_stop_ids} stop_token_ids", "stop_token_ids")
        if req.stop_token_ids:
            self._check_ids(req.stop_token_ids, "stop_token_ids")
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            min_p=req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=req.top_n,
            prompt_logprobs=req.top_n is not None and req.echoes,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=self._logit_bias(req.logit_bias),
            constraint=constraint,
        )
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e)) from None
        prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
        return Prepared(
            rid=f"{prefix}-{uuid.uuid4().hex}",
            prompt_ids=ids,
            params=params,
            stop_strings=req.stop_strings,
            stream=req.stream,
            include_usage=req.include_usage,
            priority=effective_priority(
                lim.default_priority if key_priority is None else key_priority, req.priority
            ),
            top_n=req.top_n,
            score_only=score_only,
        )

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} map as (id, bias) pairs, each id in the vocabulary."""
        pairs = tuple((int(key), float(value)) for key, value in (bias or {}).items())
        vocab = self.tokenizer.vocab_size
        bad = next((t for t, _ in pairs if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})", "logit_bias"
            )
        if len({t for t, _ in pairs}) != len(pairs):  # "5" and "05" name one token
            raise bad_request("logit_bias names a token more than once", "logit_bias")
        return pairs

    def _prompt_deltas(self, prep: Prepared) -> list[str]:
        """Each prompt token's share of the prompt's text, decoded as the completion's tokens are."""
        detok = self._detokenizer_factory(self.tokenizer, [])
        deltas = [detok.feed(t) for t in prep.prompt_ids]
        deltas[-1] += detok.flush()
        return deltas

    # -- generation ---------------------------------------------------------------------------
    async def submit(self, prep: Prepared) -> int:
        """Hand the request to the engine; APIError 503/400 when it cannot take it."""
        if self.draining:
            raise service_unavailable(
                "the appliance is shutting down", retry_after_s=self.limits.retry_after_s
            )
        if not self.client.engine_alive:
            self.metrics.error("engine_unavailable", prep.priority)
            raise service_unavailable(
                "the engine is not running (starting or restarting); retry shortly",
                retry_after_s=self.limits.retry_after_s,
            )
        try:
            prep.submitted_ns = time.monotonic_ns()
            rid = self.client.submit(prep.prompt_ids, prep.params, priority=prep.priority)
            if inspect.isawaitable(rid):
                rid = await rid
        except ValueError as e:
            raise bad_request(str(e)) from None
        except EngineBusyError as e:
            self.metrics.error("busy", prep.priority)
            raise service_unavailable(
                f"the engine is at capacity ({e}); retry shortly", retry_after_s=self.limits.retry_after_s
            ) from None
        except EngineDeadError as e:
            self.metrics.error("engine_unavailable", prep.priority)
            raise service_unavailable(
                f"the engine is not running: {e}", retry_after_s=self.limits.retry_after_s
            ) from None
        return int(rid)

    async def generate(self, prep: Prepared) -> AsyncIterator[Piece]:
        """Submit, yield one empty piece once admitted, then text pieces; the last carries the finish
        reason. Raises APIError instead of the admission piece when the request cannot be admitted,
        and EngineFailure when the engine fails it later. Close the generator (aclosing) to cancel."""
        request_id = await self.submit(prep)
        try:
            yield Piece("")  # admitted: the caller may now commit to a 200 (e.g. start an SSE stream)
        except GeneratorExit:  # closed before its stream opened (the client left during the headers)
            self.client.abandon(request_id)
            raise
        self._inflight.count += 1
        self._inflight.idle.clear()
        timer = self.metrics.request_timer(
            prep.prompt_tokens, prep.priority, prep.arrived_ns, prep.submitted_ns
        )
        detok = self._detokenizer_factory(self.tokenizer, prep.prompt_ids)
        stops = StopStringMatcher(prep.stop_strings)
        choice = ChoiceLogprobs(prep.top_n is not None)
        echo = prep.echo
        finished = False
        try:
            # Tokens that reached the front end together go out as one piece: per-token work sets the
            # pace under load. A whole response (no stop strings) makes its text at the end, in turns.
            whole = not prep.stream and not prep.stop_strings
            feed = detok.hold if whole and not choice.wanted else detok.feed  # no piece needed per token
            events = self.client.stream_batches(request_id, whole=whole)
            if whole:
                events = self._turns.sliced(events, prep.priority)
            async with contextlib.aclosing(events):  # leaving early cancels in the engine
                async for batch in events:
                    text = ""
                    if not prep.score_only:
                        timer.batch(batch)
                    for ev in batch:
                        run = isinstance(ev, TokenRun)  # whole, so no stop strings and no logprobs
                        if echo is not None and (run or ev.token_id is not None):  # the prompt comes first
                            text, echo = echo, None
                            prompt_lps = None if run else ev.prompt_logprobs
                            choice.prompt(prep.prompt_ids, self._prompt_deltas(prep), prompt_lps)
                        if run:
                            if not prep.score_only:
                                prep.completion_tokens += len(ev.token_ids)
                                text += stops.feed("".join(map(feed, ev.token_ids)))
                            continue
                        reason = ev.finish_reason
                        if ev.token_id is not None and not prep.score_only:
                            prep.completion_tokens += 1
                            # A stop token (EOS or stop_token_ids) ends the text; it is not part of it.
                            piece = "" if reason == FinishReason.STOP else feed(ev.token_id)
                            if choice.wanted:
                                choice.token(ev.logprobs, piece)
                            text += stops.feed(piece)
                            if stops.stopped:
                                finished = True
                                timer.finish("stop")
                                yield Piece(text, "stop", choice.take())
                                return
                        if prep.score_only and reason is FinishReason.STOP:  # it stopped on the dropped token
                            reason = FinishReason.LENGTH
                        if reason is None:
                            continue
                        if reason in (FinishReason.ABORT, FinishReason.ERROR):
                            finished = True
                            timer.error("engine_" + reason.value)
                            # What came before the failure still reaches the client.
                            if text or choice.pending:
                                yield Piece(text, None, choice.take())
                            raise EngineFailure(ev.error or f"the engine ended the request ({reason.value})")
                        text += stops.feed(detok.flush())
                        text += stops.flush()  # nothing once a stop string matched
                        finished = True
                        final = "stop" if stops.stopped else reason.value
                        timer.finish(final)
                        yield Piece(text, final, choice.take())
                        return
                    if text or choice.pending:
                        yield Piece(text, None, choice.take())
            # The stream ended without a terminal event: the ring lost the request.
            finished = True
            timer.error("engine_lost")
            raise EngineFailure("the engine stopped answering this request")
        except (EngineDeadError, EngineBusyError) as e:
            finished = True
            timer.error("engine_died")
            raise EngineFailure(f"the engine failed while generating: {e}") from None
        finally:
            if not finished:
                timer.finish("abort")  # client went away; aclosing above cancelled the request
            self._inflight.count -= 1
            if self._inflight.count == 0:
                self._inflight.idle.set()

"""The HF transformers baseline of bench/compare: a minimal OpenAI-compatible server over `generate`.

    python -m bench.hf_baseline --model dummy:llama-3.2-1b --dtype bfloat16 \
        --device cuda:0 --port 0          # prints its URL on stdout once it serves

What it is, so the comparison is honest:
- Model: transformers' own LlamaForCausalLM holding the `dummy:` preset's random weights drawn
  from the same seed as the appliance's (model/loaders/dummy.py), in the same dtype on the same
  device; transformers' default attention and cache (DynamicCache), `model.generate`, greedy.
- Batching: static batches. One worker thread takes the oldest waiting request and every other
  request waiting at that moment (up to --max-batch), left-pads their prompts and runs one
  `generate` over them. Requests that arrive meanwhile wait for the next batch (no joining
  mid-batch, no continuous batching). A row whose request is done (its max_tokens, EOS, or its
  client gone) is still computed until the whole batch ends; its extra tokens are dropped.
- Streaming: a streamer receives each step's tokens from `generate` and hands them to the
  requests' streams; the text of a token is its id (" 17"), as the appliance's front end writes
  it for models without a tokenizer (frontend/token_id_vocabulary.py).
- API: POST /v1/completions with a token-id prompt, `max_tokens`, `temperature` 0, `stream`,
  `stream_options.include_usage`, `ignore_eos`; anything else is refused with 400. GET /health
  (with `inflight`) and /v1/models.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from blink_appliance.processes import watch_parent

log = logging.getLogger("bench.hf_baseline")

DEFAULT_MAX_TOKENS = 16
PAD_ID = 0  # left padding; masked out by the attention mask
_ACCEPTED_KEYS = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos"}


class BaselineUnavailable(RuntimeError):
    """transformers is missing, or the model cannot be expressed as a transformers model."""


# -- the model ---------------------------------------------------------------------------------


def hf_llama_config(config: Any) -> Any:
    """transformers' LlamaConfig for one of our ModelConfigs (llama architecture only)."""
    try:
        import transformers
    except ImportError as e:
        raise BaselineUnavailable(f"the HF baseline needs transformers: {e}") from None
    if config.arch != "llama":
        raise BaselineUnavailable(f"the HF baseline maps llama presets only, not {config.arch!r}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        # No EOS in the model's own generation defaults: generate() must not end rows at an EOS;
        # each request's EOS is its own business (ignore_eos, see Job.feed).
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:  # transformers 4 spells the same settings as rope_theta + rope_scaling
        kwargs["rope_theta"] = config.rope_theta
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return transformers.LlamaConfig(**kwargs)


def build_hf_model(config: Any, weights: dict[str, Any], *, dtype: str, device: str) -> Any:
    """transformers' LlamaForCausalLM holding `weights` (HF names, as our loaders produce them)."""
    import torch

    hf_config = hf_llama_config(config)
    import transformers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built as from_pretrained(dtype=...) builds it
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise BaselineUnavailable(f"weight names do not match: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def load_dummy_model(source: str, *, dtype: str, device: str, seed: int = 0) -> tuple[Any, Any]:
    """(transformers model, our ModelConfig) for a `dummy:` source, weights equal to the appliance's."""
    kind, _, preset = source.partition(":")
    if kind != "dummy" or not preset:
        raise BaselineUnavailable(f"the HF baseline serves dummy: presets only, not {source!r}")
    from blink_appliance.model.loaders.dummy import random_weights
    from blink_appliance.model.presets import preset_config

    config = preset_config(preset)
    hf_llama_config(config)  # refuses a missing transformers or another architecture before the weights
    return build_hf_model(config, random_weights(config, seed=seed), dtype=dtype, device=device), config


# -- static batches ----------------------------------------------------------------------------


@dataclass
class Job:
    """One request: its prompt, limits, and the stream its tokens go to (on the server's event loop)."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[int | None, str | None, str | None]] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    done: bool = False  # set by the worker thread once the finish event is queued
    cancelled: threading.Event = field(default_factory=threading.Event)  # the client went away

    def _send(self, token: int | None, finish: str | None, error: str | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, (token, finish, error))

    def feed(self, token: int, eos_ids: frozenset[int]) -> None:
        """One generated token for this row (worker thread)."""
        if self.done or self.cancelled.is_set():
            return
        self.emitted += 1
        if not self.ignore_eos and token in eos_ids:
            finish: str | None = "stop"
        else:
            finish = "length" if self.emitted >= self.max_tokens else None
        self.done = finish is not None
        self._send(token, finish)

    def fail(self, message: str) -> None:
        if not self.done:
            self.done = True
            self._send(None, "error", message)


class StaticBatcher:
    """The worker thread: batches of waiting jobs through `generate`, one batch at a time."""

    def __init__(self, model: Any, eos_ids: Sequence[int], *, max_batch: int, device: str) -> None:
        self.model = model
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.max_batch = max_batch
        self.device = device
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf-generate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def submit(self, job: Job) -> None:
        self.waiting.put(job)

    def _next_batch(self) -> list[Job]:
        try:
            first = self.waiting.get(timeout=0.2)
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < self.max_batch:
            try:
                batch.append(self.waiting.get_nowait())
            except queue.Empty:
                break
        return [j for j in batch if not j.cancelled.is_set()]

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._next_batch()
            if not batch:
                continue
            try:
                self.generate(batch)
            except Exception as e:  # one bad batch fails its requests, not the server
                log.exception("generate failed for a batch of %d", len(batch))
                for job in batch:
                    job.fail(f"generate failed: {type(e).__name__}: {e}")
            self.batches += 1

    def generate(self, batch: list[Job]) -> None:
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):  # left padding: every row's last prompt token is aligned
            ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids) :] = 1
        eos_ids = self.eos_ids

        class RowStreamer(BaseStreamer):
            """generate() puts the prompt once, then each step's tokens (one per row)."""

            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                for job, token in zip(batch, value.reshape(-1).tolist(), strict=True):
                    job.feed(int(token), eos_ids)

            def end(self) -> None:
                pass

        class RowsDone(StoppingCriteria):
            """A row is done at its own max_tokens, EOS or cancel; generate ends when all are."""

            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                generated = input_ids.shape[1] - width
                done = [j.done or j.cancelled.is_set() or generated >= j.max_tokens for j in batch]
                return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

        config = GenerationConfig(
            max_new_tokens=max(j.max_tokens for j in batch),
            do_sample=False,
            pad_token_id=PAD_ID,
            eos_token_id=None,  # EOS is each request's own business (ignore_eos); see Job.feed
        )
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([RowsDone()]),
                streamer=RowStreamer(),
            )
        for job in batch:  # generate ended (all rows done): nothing more comes for any row
            if not job.done and not job.cancelled.is_set():
                job.fail(f"generate stopped after {job.emitted} of {job.max_tokens} tokens")


# -- HTTP --------------------------------------------------------------------------------------


@dataclass
class BaselineState:
    name: str
    vocab_size: int
    max_model_len: int
    batcher: StaticBatcher
    inflight: int = 0


STATE = web.AppKey("hf_baseline", BaselineState)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    from blink_appliance.frontend.errors import APIError

    return APIError(status, message, param=param).response()


@dataclass(frozen=True)
class CompletionAsk:
    prompt: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool


def parse_completion(body: Any, state: BaselineState) -> CompletionAsk | web.Response:
    """The request, or the 400/404 to send."""
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    extra = sorted(set(body) - _ACCEPTED_KEYS)
    if extra:
        return _error(400, f"'{extra[0]}' is not supported by the HF baseline", extra[0])
    if body.get("model") != state.name:
        return _error(
            404, f"the model '{body.get('model')}' does not exist; this serves '{state.name}'", "model"
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
        return _error(
            400, "prompt must be a non-empty list of token ids (this model has no tokenizer)", "prompt"
        )
    if not all(0 <= t < state.vocab_size for t in prompt):
        return _error(400, f"prompt: token ids must be in [0, {state.vocab_size})", "prompt")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1 or len(prompt) + max_tokens > state.max_model_len:
        return _error(
            400, f"max_tokens must be >= 1 and fit max_model_len {state.max_model_len}", "max_tokens"
        )
    if body.get("temperature", 1.0) != 0:
        return _error(400, "the HF baseline is greedy only: send temperature 0", "temperature")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        return _error(400, "stream_options: only include_usage is supported", "stream_options")
    return CompletionAsk(
        prompt,
        max_tokens,
        bool(body.get("stream")),
        bool(options.get("include_usage")),
        bool(body.get("ignore_eos")),
    )


async def completions(request: web.Request) -> web.StreamResponse:
    from blink_appliance.frontend.openai_schema import completion_body, completion_chunk, usage
    from blink_appliance.frontend.token_id_vocabulary import token_ids_text

    state = request.app[STATE]
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        return _error(400, f"the request body is not valid JSON: {e}")
    ask = parse_completion(body, state)
    if isinstance(ask, web.Response):
        return ask
    job = Job(ask.prompt, ask.max_tokens, ask.ignore_eos, asyncio.get_running_loop())
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.name
    state.inflight += 1
    state.batcher.submit(job)
    response: web.StreamResponse | None = None
    try:
        if ask.stream:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)

        async def send(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            assert response is not None
            await response.write(f"data: {data}\n\n".encode())

        texts: list[str] = []
        while True:
            token, finish, error = await job.events.get()
            if error is not None:
                if response is None:
                    return _error(500, error)
                await send({"error": {"message": error, "type": "server_error", "param": None, "code": None}})
                await send("[DONE]")
                return response
            text = "" if token is None or finish == "stop" else token_ids_text([token])
            if response is None:
                texts.append(text)
            elif text or finish:
                await send(completion_chunk(rid, model, created, text=text, finish_reason=finish))
            if finish is not None:
                break
        use = usage(len(ask.prompt), job.emitted)
        if response is None:
            return web.json_response(completion_body(rid, model, "".join(texts), finish, use, created))
        if ask.include_usage:
            await send(completion_chunk(rid, model, created, text=None, usage_=use))
        await send("[DONE]")
        await response.write_eof()
        return response
    finally:
        job.cancelled.set()  # a no-op once done; otherwise the client left and its row stops counting
        state.inflight -= 1


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"status": "ok", "model": state.name, "inflight": state.inflight})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [{"id": state.name, "object": "model", "created": 0, "owned_by": "hf-transformers-baseline"}]
    return web.json_response({"object": "list", "data": data})


def create_app(state: BaselineState) -> web.Application:
    app = web.Application(client_max_size=1 << 22)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    return app


async def serve(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    model, config = await asyncio.to_thread(
        load_dummy_model, args.model, dtype=args.dtype, device=args.device, seed=args.seed
    )
    log.info("loaded %s (%s on %s) in %.1f s", args.model, args.dtype, args.device, time.monotonic() - t0)
    batcher = StaticBatcher(model, config.eos_token_ids, max_batch=args.max_batch, device=args.device)
    batcher.start()
    name = args.name or args.model.partition(":")[2]
    state = BaselineState(
        name, config.vocab_size, min(args.max_model_len, config.max_position_embeddings), batcher
    )
    runner = web.AppRunner(
        create_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=2.0
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    port = sockets[0].getsockname()[1] if sockets else args.port
    print(f"http://{args.host}:{port}", flush=True)  # stdout carries only the URL, as `up` does
    log.info("serving %s with static batches of up to %d", name, args.max_batch)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, lambda: loop.call_soon_threadsafe(stop.set))
    await stop.wait()
    batcher.stop()
    await runner.cleanup()


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, sep, hi = part.partition("-")
        out.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hf_baseline", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-3.2-1b", help="a dummy: preset (llama architecture)")
    p.add_argument("--name", default=None, help="the model name clients send (default: the preset's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--seed", type=int, default=0, help="seed of the dummy weights (as models[].seed)")
    p.add_argument("--max-batch", type=int, default=64, help="requests per static batch at most")
    p.add_argument("--max-model-len", type=int, default=4096, help="prompt + max_tokens at most")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--cpus", default=None, help="pin this server, e.g. 1-3")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[hf-baseline] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops it with SIGTERM
    if args.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if args.cpus:
        os.sched_setaffinity(0, _cpus(args.cpus))
    try:
        asyncio.run(serve(args))
    except BaselineUnavailable as e:
        print(f"[hf-baseline] unavailable: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

"""The front-end process: `python -m blink_appliance.frontend PROFILE [--host H] [--port P] [--ready-file F]`.

Attaches to every model's ring region the daemon created (one engine per model), serves HTTP
(each request goes to the model it names: model_router.py), and on SIGTERM drains: new requests get
503, in-flight ones get `appliance.drain_timeout_s` to finish, the rest are cancelled, exit 0.
SIGINT is ignored (the daemon decides); see engine/process.py for why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from aiohttp import web
from blink_appliance.frontend.loop_lag import LoopLag

from blink_appliance.processes import pin_cpus, watch_parent
from blink_appliance.profile import (
    ModelSection,
    Profile,
    ProfileError,
    load_profile,
    region_name,
    ring_geometry,
)

if TYPE_CHECKING:
    from blink_appliance.frontend.engine_links import EngineLinks
    from blink_appliance.frontend.model_router import ModelRouter
    from blink_appliance.frontend.token_id_vocabulary import TokenIdVocabulary

    from blink_appliance.model.tokenizer import Tokenizer
    from blink_appliance.telemetry.source import TelemetrySource
    from blink_appliance.wire.ring_layout import RingGeometry

log = logging.getLogger("blink_appliance.frontend")
SWITCH_INTERVAL_S = 0.001


def serving_tokenizer(source: str, key: str = "models[0].source") -> Tokenizer | TokenIdVocabulary:
    """The tokenizer the front end serves `source` (the profile's `key`) with: the model's own, or for a
    `dummy:` preset (which has none) token-id prompts in and ids as text out (token_id_vocabulary.py)."""
    from blink_appliance.frontend.token_id_vocabulary import token_id_vocabulary_for

    from blink_appliance.model.sources import load_tokenizer

    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        return tokenizer
    vocabulary = token_id_vocabulary_for(source)
    if vocabulary is None:
        raise ProfileError(
            f"{key}: {source!r} has no tokenizer, and the HTTP front end needs one "
            "(only dummy: models are served without one, with token-id prompts)"
        )
    log.info("%s has no tokenizer: token-id prompts only, output text is the ids", source)
    return vocabulary


def gpu_indices(models: list[ModelSection]) -> list[int]:
    """The GPUs NVML samples: every one a model's engine runs on (replicas, tensor-parallel ranks), so
    that power and J/token count them all; GPU 0 when none does."""
    devices = [d for m in models for d in m.rank_devices if d != "cpu"]
    return sorted({int(d.partition(":")[2] or 0) for d in devices}) or [0]


async def serve(
    profile: Profile, ready_file: Path | None, parent_pid: int | None, *, url_out: TextIO | None = None
) -> None:
    # First: a SIGTERM while this process starts must still end in the drain below (exit 0), not in
    # the default action; and none can arrive between listening and having a handler.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if url_out is not None:  # standalone, no daemon to decide: Ctrl-C drains too
        loop.add_signal_handler(signal.SIGINT, stop.set)
    if parent_pid is not None:
        watch_parent(parent_pid, lambda: loop.call_soon_threadsafe(stop.set))
    from blink_appliance.frontend.app import create_app, runner_for
    from blink_appliance.frontend.auth import configured_keys
    from blink_appliance.frontend.engine_links import RegionPlan, attach_engines, detach_engines

    models, fe = profile.models, profile.frontend
    pin_cpus(fe.cpus, "frontend.cpus", ProfileError)
    # Each model's tokenizer in its own thread: loading them one after another adds up. Replicas
    # of a model share it.
    firsts = [i for i, m in enumerate(models) if not m.replica]
    loaded = await asyncio.gather(
        *(
            asyncio.to_thread(serving_tokenizer, models[i].model_source, models[i].key("source"))
            for i in firsts
        )
    )
    by_name = {models[i].name: tokenizer for i, tokenizer in zip(firsts, loaded, strict=True)}
    tokenizers = [by_name[m.name] for m in models]
    geometries = [ring_geometry(profile, i) for i in range(len(models))]
    plans = [
        RegionPlan(m.name, region_name(profile, i), geometries[i], m.key(replica=True))
        for i, m in enumerate(models)
    ]
    dpu = profile.dpu if fe.transport == "nixl" else None
    links = await attach_engines(
        plans, request_timeout_s=fe.request_timeout_s, stall_limit_s=profile.engine.stall_limit_s, dpu=dpu
    )
    try:
        router, telemetry = _services(profile, links, tokenizers, geometries, parent_pid)
        app = create_app(
            router,
            api_keys=configured_keys(fe.api_keys),
            max_request_bytes=fe.max_request_bytes,
            body_timeout_s=fe.body_timeout_s,
            telemetry=telemetry,
        )
        # handler_cancellation: a client that disconnects cancels its handler, hence its request.
        runner = runner_for(app, header_timeout_s=fe.header_timeout_s)
        await runner.setup()
    except BaseException:
        await detach_engines(links)
        raise
    site = web.TCPSite(runner, fe.host, fe.port, backlog=1024)
    try:
        await site.start()
    except OSError as e:  # up checked the port before the engine loaded; another program took it since
        await detach_engines(links)
        await runner.cleanup()
        raise ProfileError(f"frontend.port: cannot listen on {fe.host}:{fe.port} ({e.strerror})") from None
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    port = sockets[0].getsockname()[1] if sockets else fe.port
    host = f"[{fe.host}]" if ":" in fe.host else fe.host
    url = f"http://{host}:{port}"
    log.info("front end serving %s on %s", ", ".join(router.names), url)
    if url_out is not None:
        print(url, file=url_out, flush=True)  # as `up` does: stdout carries only the URL, for scripts
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(url)
        tmp.replace(ready_file)  # atomic: the daemon never reads half a URL

    unwatch_gc = router.metrics.watch_gc()
    lag = LoopLag.from_env(router.metrics.loop_lag.observe)
    lag.start()
    # Every stream waits out a collection. What start-up built lives as long as the process: frozen,
    # collections skip it. Objects alive at once under load (streams' token events, requests in
    # flight) set off a young collection at every 700 allocations at the default (485 collections,
    # 0.69 s in 22 s on an H100 host; at 50k: one, 41 ms; bench/results/2026-11-27-h100-frontend-reads.md).
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)
    # The telemetry samplers' threads hold the GIL for up to the switch interval whenever they
    # run, and the event loop waits that long: 1 ms, not 5 (bench/results/2026-11-27-h100-loop-lag.md).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    await stop.wait()

    # Drain: refuse new work with 503, let in-flight requests finish, cancel what is left. Should
    # stopping hang past what the daemon waits (drain + 10 s), the log shows where.
    faulthandler.dump_traceback_later(profile.appliance.drain_timeout_s + 8.0)
    router.draining = True
    log.info("draining %d in-flight request(s)", router.inflight)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(router.wait_idle(), profile.appliance.drain_timeout_s)
    if router.inflight:
        log.warning("drain timeout: cancelling %d request(s)", router.inflight)
    await detach_engines(links)  # cancels and ends what is still open, then closes the regions
    await runner.cleanup()
    faulthandler.cancel_dump_traceback_later()
    unwatch_gc()
    lag.stop()


def _services(
    profile: Profile,
    links: EngineLinks,
    tokenizers: list[Any],
    geometries: list[RingGeometry],
    parent_pid: int | None,
) -> tuple[ModelRouter, TelemetrySource | None]:
    """One CompletionService per model (its engine link, or its replicas' behind a ReplicaSet; its
    tokenizer, limits, metrics), the router over them, and the telemetry source that watches them."""
    from blink_appliance.frontend.completion_service import CompletionService, ServiceLimits
    from blink_appliance.frontend.metrics import MetricsRegistry, ServingMetrics
    from blink_appliance.frontend.model_router import ModelRouter
    from blink_appliance.frontend.replicas import ReplicaSet

    from blink_appliance.model.detokenizer import IncrementalDetokenizer
    from blink_appliance.telemetry.gpu import GpuSampler
    from blink_appliance.telemetry.host import HostSampler
    from blink_appliance.telemetry.sm_share import sm_shares
    from blink_appliance.telemetry.source import TelemetrySource

    models = profile.models
    one = len(models) == 1
    clients: dict[str, Any] = {}  # each model's client: its engine's, or its replicas' ReplicaSet

    def appliance_processes() -> dict[str, int | None]:
        # Each engine's pid from its ring header, read each sample: it changes when the daemon
        # restarts that engine. The daemon is this process's parent (--parent-pid). Over NIXL they
        # are another host's processes, which this host cannot sample.
        if links.remote is not None:
            return {"frontend": os.getpid()}
        names = [
            "engine" if one else f"engine:{m.name}" + (f"#{m.replica}" if m.replica else "") for m in models
        ]
        engines = {
            name: link.client.region.load("engine_pid") for name, link in zip(names, links, strict=True)
        }
        return {"daemon": parent_pid, "frontend": os.getpid(), **engines}

    telemetry = (
        TelemetrySource(
            lambda: {name: client.telemetry() for name, client in clients.items()},
            models=list(dict.fromkeys(m.name for m in models)),
            interval_s=profile.telemetry.interval_s,
            host=HostSampler(appliance_processes),
            gpu=GpuSampler(gpu_indices(models)),
            device=models[0].device,
            devices={m.name: m.device for m in models},
            sm_shares=sm_shares((m.name, m.device, m.sm_count) for m in models),
        )
        if profile.telemetry.enabled
        else None
    )

    def detokenizer(tok: object, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=True)

    registry = MetricsRegistry()  # one /metrics for every model, told apart by model_name
    services = []
    for m, tokenizer, geometry in zip(models, tokenizers, geometries, strict=True):
        if m.replica:
            continue
        replicas = [link.client for link, r in zip(links, models, strict=True) if r.name == m.name]
        client = clients[m.name] = replicas[0] if len(replicas) == 1 else ReplicaSet(replicas)
        refusal = constraint_refusal(geometry.constraint_words, tokenizer, m.name)
        metrics = ServingMetrics(
            m.name,
            engine_telemetry=client.telemetry,
            engine_alive=lambda client=client: client.engine_alive,
            tracker=telemetry.latency(m.name) if telemetry is not None else None,
            class_tracker=(
                (lambda priority, name=m.name: telemetry.class_latency(name, priority))
                if telemetry is not None
                else None
            ),
            registry=registry,
        )
        limits = ServiceLimits(
            model_name=m.name,
            max_model_len=m.max_model_len,
            max_prompt_tokens=geometry.max_prompt_tokens,
            max_output_tokens=geometry.max_output_tokens,
            max_stop_ids=geometry.max_stop_ids,
            default_priority=m.priority,
            shares_prefixes=geometry.prefix_block_size > 0,
            logprobs_refusal=logprobs_refusal(geometry.logprob_pairs),
            constraint_refusal=refusal,
        )
        constraints = None
        if refusal is None:
            from blink_appliance.frontend.structured_output import ConstraintCompiler

            constraints = ConstraintCompiler(tokenizer, tokenizer.eos_token_ids, geometry.constraint_words)
        services.append(CompletionService(client, tokenizer, detokenizer, limits, metrics, constraints))
    return ModelRouter(services), telemetry


def logprobs_refusal(logprob_pairs: int) -> str | None:
    """Why a model's requests cannot have logprobs (nor the prompt's); None where its engine gives them."""
    if not logprob_pairs:
        return "logprobs are off: this appliance's profile sets frontend.logprob_pairs = 0"
    return None


def constraint_refusal(constraint_words: int, tokenizer: object, model: str) -> str | None:
    """Why a model's requests cannot be constrained (structured output); None where they can."""
    if not constraint_words:
        return "structured output is off: this appliance's profile sets frontend.constraint_words = 0"
    if not getattr(tokenizer, "eos_token_ids", None):
        return (
            f"the model {model} has no tokenizer with an end-of-sequence token: structured output needs one"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m blink_appliance.frontend", description="the HTTP front end"
    )
    parser.add_argument("profile")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--ready-file", type=Path, default=None, help="write the served URL here when ready")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--standalone", action="store_true", help="no daemon: SIGINT drains as SIGTERM does")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Until serve() puts the loop's handler in its place: nothing is accepted yet, so just exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        profile = load_profile(args.profile).with_overrides(host=args.host, port=args.port)
    except ProfileError as e:
        print(f"[frontend] {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=profile.appliance.log_level.upper(), format="[frontend] %(levelname)s %(name)s: %(message)s"
    )
    url_out = None
    if args.standalone:  # the URL alone on stdout; whatever libraries print there (UCX) goes to stderr
        url_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    try:
        asyncio.run(serve(profile, args.ready_file, args.parent_pid, url_out=url_out))
    except ProfileError as e:
        print(f"[frontend] {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

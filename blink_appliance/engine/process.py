"""The engine process: profile -> load the model -> the engine on the shared rings: the CPU
reference engine (LLMEngine under EngineServer) for engine.mode "reference", the GPU loop
(LoopStep under LoopEngineServer) for "loop" and "host".

Started by the daemon (`python -m blink_appliance.engine.process PROFILE --model I`), one process
per model, after it created the model's ring region. Several GPU loops on one device run as several
such processes under MPS (blink_appliance/mps.py). It serves until SIGTERM (or the region's shutdown
word), then aborts what is in flight and exits 0. It ignores SIGINT: a Ctrl-C in the terminal
reaches the whole process group, and only the daemon decides how the appliance drains.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from blink_appliance.engine.plan import ModelPlan, resolve_plan, resolve_plans
from blink_appliance.model.config import ModelConfig
from blink_appliance.processes import pin_cpus, set_on_signals, watch_parent
from blink_appliance.profile import Profile, ProfileError, load_profile, region_name, ring_geometry

if TYPE_CHECKING:
    from blink_appliance.engine.reference.engine import EngineConfig

log = logging.getLogger("blink_appliance.engine")
# Set once the engine serves. Before that nothing was accepted (the front end submits only to a
# RUNNING engine), so a lost daemon ends the process at once instead of after a build of minutes.
SERVING = threading.Event()


def _stage(message: str) -> float:
    print(f"[engine] {message} ...", file=sys.stderr, flush=True)
    return time.monotonic()


def _done(t0: float) -> None:
    print(f"[engine]   done in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def serve(
    profile: Profile, index: int, stop: threading.Event, *, device_free_bytes: int | None = None
) -> None:
    """Serve models[index]: on the CPU reference engine, or on the GPU loop."""
    if profile.uses_loop_of(index):
        serve_loop(profile, index, stop, device_free_bytes=device_free_bytes)
    else:
        serve_reference(profile, index, stop)


def model_plan(profile: Profile, index: int, config: ModelConfig, device_free_bytes: int | None) -> ModelPlan:
    """models[index]'s plan. Beside other models on its CUDA device, its kv_fraction is of the memory
    the daemon read free before any of them started, less all their weights: each engine process
    starts on its own, so what is free when it starts depends on which started first."""
    m = profile.models[index]
    others = [j for j, o in enumerate(profile.models) if j != index and o.device == m.device != "cpu"]
    if not others or m.kv_fraction is None:
        return resolve_plan(m, config)
    if device_free_bytes is None:
        raise ProfileError(
            f"{m.key('kv_fraction')}: {m.device} serves {len(others) + 1} models; the engine needs "
            "--device-free-bytes (the daemon passes it)"
        )
    from blink_appliance.model.metadata import read_checkpoint_info

    configs = {j: read_checkpoint_info(profile.models[j].model_source).config for j in others}
    return resolve_plans(profile, {index: config, **configs}, available_bytes=device_free_bytes)[index]


def reference_config(profile: Profile, plan: ModelPlan, eos_token_ids: tuple[int, ...]) -> EngineConfig:
    """The CPU reference engine's settings for a model of the profile, from its plan."""
    from blink_appliance.engine.reference.engine import EngineConfig

    return EngineConfig(
        block_size=plan.block_size,
        num_kv_blocks=plan.num_kv_blocks,
        max_num_seqs=plan.max_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=plan.max_model_len,
        eos_token_ids=eos_token_ids,
        **profile.engine.scheduling,
    )


def serve_reference(profile: Profile, index: int, stop: threading.Event) -> None:
    """models[index] on the CPU reference engine, on its own ring region."""
    import torch

    from blink_appliance.engine.reference.engine import LLMEngine
    from blink_appliance.engine.reference.server import EngineServer
    from blink_appliance.model.loaders import build_model, load_checkpoint
    from blink_appliance.wire.shm_transport import ShmTransport

    m = profile.models[index]
    pin_cpus(profile.appliance.engine_cpus, "appliance.engine_cpus", ProfileError)
    t0 = _stage(f"loading {m.model_source}")
    ckpt = load_checkpoint(m.model_source, seed=m.seed, quantized=m.cpu_weights == "quantized")
    plan = resolve_plan(m, ckpt.config)
    model = build_model(ckpt, dtype=getattr(torch, m.dtype), device=m.device)
    del ckpt  # the fp32 copy of the weights; the model holds its own
    _done(t0)
    print(plan.describe(), file=sys.stderr, flush=True)
    engine = LLMEngine(model, reference_config(profile, plan, tuple(model.config.eos_token_ids)))
    transport = ShmTransport.open(region_name(profile, index))
    try:
        ring = ring_geometry(profile, index)
        server = EngineServer(engine, transport, ring, vocab_size=model.config.vocab_size)
        print(f"[engine] serving {m.name!r} on the rings", file=sys.stderr, flush=True)
        SERVING.set()
        server.run(stop)
    finally:
        transport.close()


def serve_loop(
    profile: Profile, index: int, stop: threading.Event, *, device_free_bytes: int | None = None
) -> None:
    """models[index] on the GPU loop (engine.mode "loop" or "host"): build it, serve until stopped,
    release it."""
    m, mode = profile.models[index], profile.engine_mode_of(index)
    if m.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # On the CPU the loop's Triton kernels can only run in the interpreter; nothing imported
        # them yet in this fresh process, so the setting still takes effect.
        os.environ["TRITON_INTERPRET"] = "1"
        print("[engine] device cpu: the loop's kernels run under the Triton interpreter", file=sys.stderr)
    from blink_appliance.engine.loop.server import build_loop_server
    from blink_appliance.model.loaders import load_checkpoint
    from blink_appliance.wire.shm_transport import ShmTransport

    pin_cpus(profile.appliance.engine_cpus, "appliance.engine_cpus", ProfileError)
    t0 = _stage(f"loading {m.model_source}")
    ckpt = load_checkpoint(m.model_source, seed=m.seed)
    plan = model_plan(profile, index, ckpt.config, device_free_bytes)
    _done(t0)
    print(plan.describe(), file=sys.stderr, flush=True)
    transport = ShmTransport.open(region_name(profile, index))
    try:
        t0 = _stage(
            f"building the loop (engine.mode {mode!r} on {m.device}: weights, KV cache, kernels, graphs)"
        )
        server = build_loop_server(profile, ckpt, plan, transport, index=index)
        del ckpt  # the host copy of the weights; the device holds its own
        _done(t0)
        print(f"[engine] serving {m.name!r} on the rings ({mode} mode)", file=sys.stderr, flush=True)
        try:
            SERVING.set()
            server.run(stop)
        finally:
            server.close()
            del server
            gc.collect()  # views of the shared region must go before it is unmapped
    finally:
        try:
            transport.close()
        except BufferError:  # a view is still alive (an exception's frames hold it): exit unmaps
            log.warning("the ring region is still referenced; it is unmapped at exit")


def _model_index(profile: Profile, value: int | None) -> int:
    """--model: which of the profile's models this process serves (default: the only one)."""
    if value is None:
        if len(profile.models) != 1:
            raise ProfileError(
                f"the profile has {len(profile.models)} models, an engine process each; pass --model "
                "(the daemon does)"
            )
        return 0
    if not 0 <= value < len(profile.models):
        raise ProfileError(f"--model {value}: the profile has {len(profile.models)} models")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blink_appliance.engine.process")
    parser.add_argument("profile")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument(
        "--model", type=int, default=None, help="index of the model to serve (default: the only one)"
    )
    parser.add_argument(
        "--device-free-bytes", type=int, default=None,
        help="free memory of the model's CUDA device before any engine started (several models on it)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    set_on_signals(stop, (signal.SIGTERM,))
    try:
        profile = load_profile(args.profile)
        index = _model_index(profile, args.model)
    except ProfileError as e:
        print(f"[engine] {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=profile.appliance.log_level.upper(), format="[engine] %(levelname)s %(message)s"
    )
    if args.parent_pid is not None:
        parent_pid = args.parent_pid

        def parent_gone() -> None:
            if not SERVING.is_set():
                log.error("the daemon (pid %d) is gone while the engine starts; exiting", parent_pid)
                os._exit(1)
            log.error("the daemon (pid %d) is gone; stopping", parent_pid)
            stop.set()

        watch_parent(parent_pid, parent_gone)
    try:
        serve(profile, index, stop, device_free_bytes=args.device_free_bytes)
    except ProfileError as e:
        print(f"[engine] {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

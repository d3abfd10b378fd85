"""The engine process: profile -> load the model -> the engine on the shared rings: the CPU
reference engine (LLMEngine under EngineServer) for engine.mode "reference", the GPU loop
(LoopStep under LoopEngineServer) for "loop" and "host".

Started by the daemon (`python -m blink_appliance.engine.process PROFILE`) after it created the
shared region. It serves until SIGTERM (or the region's shutdown word), then aborts what is in
flight and exits 0. It ignores SIGINT: a Ctrl-C in the terminal reaches the whole process group,
and only the daemon decides how the appliance drains.
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

from blink_appliance.engine.plan import resolve_plan
from blink_appliance.processes import pin_cpus, set_on_signals, watch_parent
from blink_appliance.profile import Profile, ProfileError, load_profile, ring_geometry

log = logging.getLogger("blink_appliance.engine")
# Set once the engine serves. Before that nothing was accepted (the front end submits only to a
# RUNNING engine), so a lost daemon ends the process at once instead of after a build of minutes.
SERVING = threading.Event()


def _stage(message: str) -> float:
    print(f"[engine] {message} ...", file=sys.stderr, flush=True)
    return time.monotonic()


def _done(t0: float) -> None:
    print(f"[engine]   done in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def serve(profile: Profile, stop: threading.Event) -> None:
    import torch

    from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
    from blink_appliance.engine.reference.server import EngineServer
    from blink_appliance.model.loaders import build_model, load_checkpoint
    from blink_appliance.wire.shm_transport import ShmTransport

    m = profile.model
    if profile.uses_loop:
        serve_loop(profile, stop)
        return
    pin_cpus(profile.appliance.engine_cpus, "appliance.engine_cpus", ProfileError)
    t0 = _stage(f"loading {m.model_source}")
    ckpt = load_checkpoint(m.model_source, seed=m.seed, quantized=m.cpu_weights == "quantized")
    plan = resolve_plan(m, ckpt.config)
    model = build_model(ckpt, dtype=getattr(torch, m.dtype), device=m.device)
    del ckpt  # the fp32 copy of the weights; the model holds its own
    _done(t0)
    print(plan.describe(), file=sys.stderr, flush=True)
    engine = LLMEngine(
        model,
        EngineConfig(
            block_size=plan.block_size,
            num_kv_blocks=plan.num_kv_blocks,
            max_num_seqs=plan.max_seqs,
            max_num_batched_tokens=plan.max_num_batched_tokens,
            max_model_len=plan.max_model_len,
            eos_token_ids=tuple(model.config.eos_token_ids),
        ),
    )
    transport = ShmTransport.open(profile.appliance.shm_name)
    try:
        server = EngineServer(engine, transport, ring_geometry(profile), vocab_size=model.config.vocab_size)
        print("[engine] serving on the rings", file=sys.stderr, flush=True)
        SERVING.set()
        server.run(stop)
    finally:
        transport.close()


def serve_loop(profile: Profile, stop: threading.Event) -> None:
    """The GPU loop (engine.mode "loop" or "host"): build it, serve until stopped, release it."""
    m = profile.model
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
    plan = resolve_plan(m, ckpt.config)
    _done(t0)
    print(plan.describe(), file=sys.stderr, flush=True)
    transport = ShmTransport.open(profile.appliance.shm_name)
    try:
        t0 = _stage(
            f"building the loop (engine.mode {profile.engine_mode!r} on {m.device}: weights, KV cache, "
            "kernels, graphs)"
        )
        server = build_loop_server(profile, ckpt, plan, transport)
        del ckpt  # the host copy of the weights; the device holds its own
        _done(t0)
        print(f"[engine] serving on the rings ({profile.engine_mode} mode)", file=sys.stderr, flush=True)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blink_appliance.engine.process")
    parser.add_argument("profile")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    set_on_signals(stop, (signal.SIGTERM,))
    try:
        profile = load_profile(args.profile)
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
        serve(profile, stop)
    except ProfileError as e:
        print(f"[engine] {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

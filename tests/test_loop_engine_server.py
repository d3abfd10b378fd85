"""The GPU loop's ring server (engine/loop/server.py): the served path. The real LoopStep in mode
"host" (on the CPU under the Triton interpreter), and on a GPU also in mode "loop", streams greedy
tokens equal to the CPU reference engine's; cancel, shutdown and the engine process's SIGTERM end
requests the way the protocol says. Its life cycle with stand-ins is tests/test_loop_engine_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the loop's kernels run on the CPU under the interpreter

from blink_appliance.engine.loop.server import LoopEngineServer
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason
from blink_appliance.wire.ring_layout import EngineState
from tests.ring_support import serve_in_thread, shm_region


# -- the served path: the real loop (LoopStep) in mode "host" under the Triton interpreter -----------
def _tiny_profile(
    device: str = "cpu",
    max_model_len: int = 64,
    max_output_tokens: int = 24,
    tensor_parallel: int = 1,
    **engine,
):
    from blink_appliance.profile import parse_profile

    return parse_profile(
        {
            "appliance": {"shm_name": "unused"},
            "models": [
                {
                    "name": "tiny", "source": "dummy:tiny", "dtype": "float32", "device": device,
                    "max_seqs": 2, "max_model_len": max_model_len, "max_num_batched_tokens": 16,
                    "block_size": 4, "kv_budget_gib": 0.001, "max_output_tokens": max_output_tokens,
                    "tensor_parallel": tensor_parallel,
                }
            ],
            "engine": {"mode": "host", **engine},
            "frontend": {"max_inflight": 8},
        }
    )  # fmt: skip


@contextlib.contextmanager
def served_tiny_loop(device: str = "cpu", profile_limits: dict | None = None, **engine):
    """The tiny model behind the loop (default: mode "host") on a fresh region, run in a thread.

    On a GPU everything comes from build_loop_server. On the CPU the loop's schedule, sample and
    commit kernels run under the interpreter around the reference model's forward (LoopStep.assemble
    with tests/test_loop_step.py's ReferenceStepForward): the interpreted Triton forward takes seconds
    a step, and build_loop_server's CPU path is covered by the engine-process test below.
    """
    from blink_appliance.engine.loop.geometry import loop_geometry
    from blink_appliance.engine.loop.server import build_loop_server
    from blink_appliance.engine.loop.step import LoopStep
    from blink_appliance.engine.plan import resolve_plan
    from blink_appliance.model.loaders import load_checkpoint
    from blink_appliance.profile import ring_geometry
    from blink_appliance.wire.ring_layout import RingLayout
    from tests.test_loop_step import ReferenceStepForward

    profile = _tiny_profile(device, **(profile_limits or {}), **engine)
    ckpt = load_checkpoint("dummy:tiny", seed=0)  # = ReferenceStepForward's weights
    plan = resolve_plan(profile.model, ckpt.config)
    ring = ring_geometry(profile)
    with shm_region(ring) as transport:
        if device == "cpu":
            geometry = loop_geometry(profile, plan, ckpt.config)
            ring_bytes = torch.frombuffer(transport.buffer, dtype=torch.uint8)
            step = LoopStep.assemble(
                geometry, ReferenceStepForward(geometry), ring_bytes, RingLayout.of(ring), engine_seed=1
            )
            server = LoopEngineServer(
                RingRegion.attach(transport, ring), step.state, geometry, mode=profile.engine_mode,
                host_step=step.host_step, heartbeat_interval_s=0.02,
            )  # fmt: skip
            del ring_bytes
        else:
            server = build_loop_server(profile, ckpt, plan, transport, heartbeat_interval_s=0.02)
        stop = threading.Event()
        thread, errors = serve_in_thread(server, stop)
        try:
            yield server, transport, ring, ckpt, plan, stop
        finally:
            stop.set()
            thread.join(60)
            assert not thread.is_alive(), "loop server did not stop"
            assert not errors, errors
            server.close()


def _reference_streams(ckpt, plan, requests):
    """Greedy token streams of the CPU reference engine for (request_id, prompt, params)."""
    import torch

    from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
    from blink_appliance.model.loaders import build_model
    from blink_appliance.wire.request import Request

    model = build_model(ckpt, torch.float32, "cpu")
    engine = LLMEngine(
        model,
        EngineConfig(
            block_size=plan.block_size, num_kv_blocks=plan.num_kv_blocks, max_num_seqs=plan.max_seqs,
            max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
        ),
    )  # fmt: skip
    for rid, prompt, params in requests:
        engine.add_request(Request(rid, prompt, params))
    out: dict[int, list] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id].append((e.token_id, e.finish_reason))
    return out


TIMEOUT_S = 120.0  # a stream that never ends fails the test instead of hanging it


async def _drain(stream) -> list:
    async def all_events() -> list:
        return [e async for e in stream]

    return await asyncio.wait_for(all_events(), TIMEOUT_S)


async def _collect(client, rid):
    return await _drain(client.stream(rid))


HAVE_GPU_STACK = (
    torch.cuda.is_available()
    and importlib.util.find_spec("cupy") is not None
    and importlib.util.find_spec("cuda.bindings") is not None
)
# The CPU variants run the loop's kernels under the Triton interpreter, which this module turns on
# only where there is no GPU; on a GPU host the cuda variants cover the same path.
cpu_harness = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness (Triton interpreter)")
on_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU_STACK, reason="needs a CUDA GPU with cupy and cuda-bindings (GPU extra)"),
]


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs with peer access"
)


@pytest.mark.parametrize(
    "device, mode, tensor_parallel",
    [
        pytest.param("cpu", "host", 1, id="cpu-host", marks=cpu_harness),
        pytest.param("cuda:0", "host", 1, id="cuda-host", marks=on_gpu),
        pytest.param("cuda:0", "loop", 1, id="cuda-loop", marks=on_gpu),
        pytest.param("cuda:0", "loop", 2, id="cuda-loop-tp2", marks=[*on_gpu, two_gpus]),
    ],
)
async def test_greedy_streams_through_the_loop_equal_the_reference_engine_and_cancel_and_shutdown_work(
    device, mode, tensor_parallel
):
    from blink_appliance.wire.client import EngineClient
    from blink_appliance.wire.request import SamplingParams

    # Long enough outputs that the request in flight at shutdown is still running when the stop
    # reaches the loop (the tiny model makes a GPU loop step about 0.1 ms).
    limits = {"max_model_len": 1024, "max_output_tokens": 1000, "tensor_parallel": tensor_parallel}
    with served_tiny_loop(device, limits, mode=mode) as (server, transport, ring, ckpt, plan, stop):
        client = EngineClient.attach(transport, ring)
        await client.start()
        await _wait_async(lambda: client.engine_alive, "the loop server did not come up")

        # Greedy requests of different lengths, together: three for two sequences per step, so one
        # waits in a slot; the longest prompt is prefilled in chunks of the 16-token budget.
        prompts = [[5, 17, 33, 2, 9, 100, 7], [44, 3, 8], list(range(10, 30))]
        params = [
            SamplingParams(temperature=0.0, max_tokens=4),
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=2),
        ]
        ids = [client.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        got = await asyncio.gather(*(_collect(client, rid) for rid in ids))
        want = _reference_streams(ckpt, plan, list(zip(ids, prompts, params, strict=True)))
        for rid, events in zip(ids, got, strict=True):
            assert [(e.token_id, e.finish_reason) for e in events] == want[rid], (rid, events)
            assert all(e.error is None for e in events)
            stamps = [e.timestamp_ns for e in events if e.token_id is not None]
            assert stamps == sorted(stamps) and 0 < stamps[0] <= time.monotonic_ns()  # host clock

        # Cancel one while it decodes.
        rid = client.submit([7, 7, 7], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
        stream = client.stream(rid)
        first = await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        assert first.token_id is not None
        client.cancel(rid)
        rest = await _drain(stream)
        assert rest[-1].finish_reason is FinishReason.ABORT and rest[-1].error is None
        assert len(rest) < 1000

        # Shutdown with a request in flight: exactly one terminal, ABORT + shutdown. The daemon's way,
        # the ring's shutdown word, which the loop reads every iteration (the GPU loop makes the
        # tiny model's 1000 tokens in about 15 ms, less than a host thread may take to wake up).
        live = client.stream(client.submit([3, 1, 4], SamplingParams(max_tokens=1000, ignore_eos=True)))
        await asyncio.wait_for(live.__anext__(), TIMEOUT_S)
        client.region.store("shutdown", 1)
        stopping = time.monotonic()
        events = await _drain(live)
        assert [e.finish_reason for e in events if e.finish_reason is not None] == [FinishReason.ABORT]
        assert events[-1].finish_reason is FinishReason.ABORT and "shutdown" in events[-1].error
        await _wait_async(lambda: server.report.state == EngineState.STOPPED, "server did not stop")
        if mode == "loop":
            assert time.monotonic() - stopping < 1.0  # the launched loop stops within a second
        assert server.report.left_open == 0  # the loop itself published every terminal
        telemetry = client.telemetry()
        assert telemetry["requests_admitted"] == 5 and telemetry["requests_cancelled"] >= 1
        assert telemetry["generated_tokens"] >= sum(len(w) for w in want.values())
        await client.close()


async def _wait_async(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@cpu_harness
async def test_the_engine_process_serves_the_loop_in_host_mode_and_stops_on_sigterm(tmp_path):
    """What `up` starts for a loop profile: its own process, on a region this test creates."""
    import signal
    import subprocess
    import sys
    import textwrap

    from blink_appliance.profile import load_profile, ring_geometry
    from blink_appliance.wire.client import EngineClient
    from blink_appliance.wire.request import SamplingParams
    from tests.ring_support import unique_name

    name = unique_name()
    path = tmp_path / "loop.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [appliance]
            shm_name = "{name}"
            [[models]]
            name = "tiny"
            source = "dummy:tiny"
            device = "cpu"
            max_seqs = 2
            max_model_len = 32
            max_num_batched_tokens = 16
            block_size = 4
            kv_budget_gib = 0.001
            [engine]
            mode = "host"
            [frontend]
            max_inflight = 4
            """
        )
    )
    ring = ring_geometry(load_profile(path))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the process sets it itself
    with shm_region(ring, name) as transport:
        log = (tmp_path / "engine.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "blink_appliance.engine.process", str(path)], env=env, stderr=log
        )
        try:
            # A long stall limit: on a loaded 2-core host the engine's heartbeat once stood still for
            # 0.8 s during its first interpreted step. This test is about serving and stopping.
            client = EngineClient.attach(transport, ring, stall_limit_s=60.0)
            await client.start()
            await _wait_async(lambda: client.engine_alive, "the engine process did not come up", timeout=120)
            live = client.stream(client.submit([1, 2], SamplingParams(max_tokens=20, ignore_eos=True)))
            first = await asyncio.wait_for(live.__anext__(), TIMEOUT_S)
            assert first.token_id is not None and first.finish_reason is None
            proc.send_signal(signal.SIGTERM)
            rest = await _drain(live)
            assert rest[-1].finish_reason is FinishReason.ABORT and "shutdown" in rest[-1].error
            assert len(rest) < 19
            assert proc.wait(30) == 0
            assert transport.load_u64(208) == EngineState.STOPPED  # engine_state
            await client.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    # The build says what it is doing and how long each part took (issue 18, start-up).
    text = (tmp_path / "engine.log").read_text()
    for part in ("weights to cpu", "compiling the schedule and commit kernels (4 slots", "sampler variants"):
        assert f"{part}" in text and text.count(": done in") >= 3, text

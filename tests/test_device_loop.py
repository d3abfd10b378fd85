"""The device loop's outer graph: body planning (CPU), the control kernels' source (CPU), and on a GPU
the real mechanism: the ring mapped into the GPU, a WHILE loop ending by its own condition, SWITCH
routing over real forward bucket graphs, and the idle poll woken by a host write then stopped."""

from __future__ import annotations

import importlib.util
import re
import threading
import time

import pytest
import torch

from blink_appliance.engine.loop.control import KERNELS, Backoff, kernel_source
from blink_appliance.engine.loop.graph import (
    CaptureStep,
    RawGraph,
    SetSwitches,
    SetWhile,
    Switch,
    SwitchStep,
    engine_body,
    plan_body,
)

HAVE_GPU_STACK = (
    torch.cuda.is_available()
    and importlib.util.find_spec("cupy") is not None
    and importlib.util.find_spec("cuda.bindings") is not None
)
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    not HAVE_GPU_STACK, reason="needs a CUDA GPU with cupy and cuda-bindings (GPU extra)"
)


def _i32(value: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int32, device=device)


# -- CPU: planning and validation ------------------------------------------------------------------
def test_plan_sets_each_run_of_switches_in_one_launch_and_set_while_last():
    def a() -> None: ...

    def b() -> None: ...

    def c() -> None: ...

    s1 = Switch("bucket", _i32(), [[RawGraph(1)], [RawGraph(2)]])
    s2 = Switch("sampler", _i32(), [[a], [b]])
    s3 = Switch("third", _i32(), [[c]])
    plan = plan_body([a, b, s1, s2, c, s3])
    assert plan.switches == [s1, s2, s3]
    assert plan.steps == [
        CaptureStep([a, b, SetSwitches((0, 1))]),  # consecutive switches: one setter before the run
        SwitchStep(0),
        SwitchStep(1),
        CaptureStep([c, SetSwitches((2,))]),  # a launch between switches: its own setter after it
        SwitchStep(2),
        CaptureStep([SetWhile()]),  # a body ending in a switch still ends with a capture of set_while
    ]
    assert plan_body([s1]).steps == [
        CaptureStep([SetSwitches((0,))]),
        SwitchStep(0),
        CaptureStep([SetWhile()]),
    ]


def test_engine_body_is_schedule_bucket_switch_sampler_switch_commit():
    class Buckets:  # the part of ForwardGraphs the body uses
        buckets = (8, 32, 128)

        def raw_cuda_graph(self, num_tokens: int) -> int:
            return 1000 + num_tokens

    def schedule() -> None: ...

    def greedy() -> None: ...

    def sampled() -> None: ...

    def commit() -> None: ...

    bucket_index, sampler_index = _i32(), _i32()
    body = engine_body(
        bucket_index=bucket_index, sampler_index=sampler_index, forward=Buckets(),
        schedule=schedule, samplers=(greedy, sampled), commit=commit,
    )  # fmt: skip
    assert body[0] is schedule and body[3] is commit
    bucket, sampler = body[1], body[2]
    assert bucket.value is bucket_index and sampler.value is sampler_index
    assert [list(b) for b in bucket.branches] == [[RawGraph(1008)], [RawGraph(1032)], [RawGraph(1128)]]
    assert [list(b) for b in sampler.branches] == [[greedy], [sampled]]
    steps = plan_body(body).steps
    assert steps == [
        CaptureStep([schedule, SetSwitches((0, 1))]),
        SwitchStep(0),
        SwitchStep(1),
        CaptureStep([commit, SetWhile()]),
    ]


def test_switch_and_backoff_validation():
    with pytest.raises(ValueError, match="no branches"):
        Switch("s", _i32(), [])
    with pytest.raises(ValueError, match="branch 1 is empty"):
        Switch("s", _i32(), [[RawGraph(1)], []])
    with pytest.raises(TypeError, match="not a launch or RawGraph"):
        Switch("s", _i32(), [[7]])
    with pytest.raises(ValueError, match="int32"):
        Switch("s", torch.zeros(1, dtype=torch.int64), [[RawGraph(1)]])
    with pytest.raises(TypeError, match="launch or a Switch"):
        plan_body([42])
    with pytest.raises(ValueError, match="backoff"):
        Backoff(min_sleep_ns=10, max_sleep_ns=5)
    with pytest.raises(ValueError, match="backoff"):
        Backoff(max_sleep_ns=2_000_000)  # beyond __nanosleep's 1 ms


def test_kernel_source_declares_the_device_graph_api_and_every_kernel():
    src = kernel_source()
    # NVRTC has no declaration of it: the source must carry the exact one (ARCHITECTURE.md fact 2).
    assert re.search(
        r'extern "C" __device__ void cudaGraphSetConditional\(unsigned long long handle, unsigned int value\);',
        src,
    )
    for name in KERNELS:
        assert re.search(rf'extern "C" __global__ void {name}\(', src), f"kernel {name} missing"
    assert "__nanosleep" in src and "volatile" in src


def test_mapped_region_refuses_a_cpu_device():
    import numpy as np

    from blink_appliance.engine.loop.mapped_region import MappedRegion

    with pytest.raises(ValueError, match="CUDA device"):
        MappedRegion(np.zeros(64, dtype=np.uint8), "cpu")


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def ring():
    """A small shared-memory ring, mapped into the GPU: (RingRegion, RingWords)."""
    import os

    from blink_appliance.engine.loop.mapped_region import MappedRegion, RingWords
    from blink_appliance.wire.region import RingRegion
    from blink_appliance.wire.ring_layout import RingGeometry, region_size
    from blink_appliance.wire.shm_transport import ShmTransport

    geometry = RingGeometry(
        request_slots=8, arena_tokens=256, max_prompt_tokens=64, max_inflight=4, max_output_tokens=16
    )
    transport = ShmTransport.create(f"blink-test-loop-{os.getpid()}", region_size(geometry))
    region = RingRegion.create(transport, geometry)
    mapped = MappedRegion.of_transport(transport, "cuda")
    words = RingWords.of(mapped)
    yield region, words
    words.request_shutdown()  # a loop a failed test left running must end before the sync
    torch.cuda.synchronize()
    mapped.close()
    transport.close()


@pytest.fixture(scope="module")
def control():
    from blink_appliance.engine.loop.control import LoopControl

    return LoopControl("cuda")


@gpu
@needs_gpu
def test_mapped_ring_words_cross_both_ways(ring):
    region, words = ring
    region.store("req_head", 123)
    assert int(words.req_head.item()) == 123
    words.req_tail.fill_(77)
    torch.cuda.synchronize()
    assert region.load("req_tail") == 77
    assert words.req_head.data_ptr() == words.region.device_pointer + 64
    with pytest.raises(ValueError, match="misaligned or outside"):
        words.region.tensor(4, torch.int64, 1)


@gpu
@needs_gpu
def test_while_loop_runs_until_its_condition_drops(ring, control):
    from blink_appliance.engine.loop.graph import DeviceLoop

    _, words = ring
    n = 1000
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    keep = _i32(1, "cuda")

    def count() -> None:
        counter.add_(1)
        keep.copy_(counter < n)

    loop = DeviceLoop([count], num_active=_i32(1, "cuda"), keep_running=keep, ring=words, control=control)
    loop.launch()
    assert loop.join(timeout_s=10.0), "the loop did not end by itself"
    assert int(counter.item()) == n
    loop.close()


@gpu
@needs_gpu
def test_switches_route_to_real_forward_bucket_graphs(ring, control):
    from blink_appliance.engine.loop.forward_graphs import ForwardGraphs
    from blink_appliance.engine.loop.graph import DeviceLoop
    from blink_appliance.model.gpu_forward import GpuForward
    from blink_appliance.model.gpu_weights import GpuWeights
    from blink_appliance.model.kv_cache import PagedKVCache
    from blink_appliance.model.presets import preset_config
    from tests.model_helpers import PagedSequences

    _, words = ring
    cfg = preset_config("tiny")
    kv = PagedKVCache.allocate(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cuda")
    fwd = GpuForward(
        cfg, GpuWeights.random(cfg, torch.float32, "cuda", seed=2), kv,
        max_tokens=32, max_seqs=4, max_blocks_per_seq=8,
    )  # fmt: skip
    graphs = ForwardGraphs(fwd, (8, 32))
    graphs.capture()
    batch = PagedSequences(32, 4, 8, seed=3).batch([(0, [5, 17, 33]), (1, [44, 3])])
    R = batch.sample_rows.shape[0]
    fwd.load_batch(batch, 8)
    # What each bucket computes on these inputs (re-running rewrites the same K/V: idempotent).
    want = {T: graphs.replay(T)[:R].clone() for T in graphs.buckets}

    # Bucket value 2 and sampler value 2 mean "no branch"; the sequences cover every combination.
    buckets = [0, 1, 2, 1, 0, 0, 2, 1, 2]
    samplers = [0, 1, 0, 2, 1, 0, 2, 2, 1]
    n = len(buckets)
    bucket_seq = torch.tensor(buckets, dtype=torch.int32, device="cuda")
    sampler_seq = torch.tensor(samplers, dtype=torch.int32, device="cuda")
    it = torch.zeros(1, dtype=torch.int64, device="cuda")
    bucket_index, sampler_index, keep = _i32(0, "cuda"), _i32(0, "cuda"), _i32(1, "cuda")
    sampled = torch.zeros(R, dtype=torch.int64, device="cuda")
    branch_runs = torch.zeros(4, dtype=torch.int64, device="cuda")  # bucket 8, bucket 32, greedy, "sampled"
    logit_sums = torch.zeros(n, dtype=torch.float32, device="cuda")
    sampled_hist = torch.zeros(n, R, dtype=torch.int64, device="cuda")

    def schedule() -> None:
        bucket_index.copy_(bucket_seq[it])
        sampler_index.copy_(sampler_seq[it])
        fwd.logits.zero_()
        sampled.fill_(-1)

    def ran(i: int):
        return lambda: branch_runs[i].add_(1)

    def greedy() -> None:
        sampled.copy_(fwd.logits[:R].argmax(-1))

    def commit() -> None:
        logit_sums.index_copy_(0, it, fwd.logits[:R].sum().view(1))
        sampled_hist.index_copy_(0, it, sampled.view(1, R))
        it.add_(1)
        keep.copy_(it < n)

    body = [
        schedule,
        Switch(
            "bucket",
            bucket_index,
            [[RawGraph(graphs.raw_cuda_graph(8)), ran(0)], [RawGraph(graphs.raw_cuda_graph(32)), ran(1)]],
        ),
        Switch("sampler", sampler_index, [[greedy, ran(2)], [lambda: sampled.fill_(-7), ran(3)]]),
        commit,
    ]
    loop = DeviceLoop(body, num_active=_i32(1, "cuda"), keep_running=keep, ring=words, control=control)
    loop.launch()
    assert loop.join(timeout_s=10.0)
    loop.close()

    assert branch_runs.tolist() == [buckets.count(0), buckets.count(1), samplers.count(0), samplers.count(1)]
    for k, (b, s) in enumerate(zip(buckets, samplers, strict=True)):
        logits = want[graphs.buckets[b]] if b < 2 else torch.zeros_like(want[8])
        assert torch.allclose(logit_sums[k], logits.sum(), rtol=1e-5, atol=1e-5), f"iteration {k}"
        expect = {0: logits.argmax(-1).tolist(), 1: [-7] * R, 2: [-1] * R}[s]
        assert sampled_hist[k].tolist() == expect, f"iteration {k}: bucket {b}, sampler {s}"


@gpu
@needs_gpu
def test_idle_loop_wakes_on_a_host_write_and_stops_on_shutdown(ring, control):
    from blink_appliance.engine.loop.graph import DeviceLoop

    region, words = ring
    iterations = torch.zeros(1, dtype=torch.int64, device="cuda")
    keep = _i32(1, "cuda")

    def consume() -> None:  # what schedule does with the ring: take every published record
        words.req_tail.copy_(words.req_head)
        iterations.add_(1)
        keep.copy_(words.shutdown == 0)

    loop = DeviceLoop(
        [consume], num_active=_i32(0, "cuda"), keep_running=keep, ring=words, control=control,
        backoff=Backoff(1_000, 50_000),
    )  # fmt: skip
    loop.launch()
    time.sleep(0.05)
    assert loop.running()
    assert region.load("req_tail") == 0, "the loop ran without work"

    def front_end() -> None:
        region.doorbell("req_head", 5)

    threading.Thread(target=front_end).start()
    deadline = time.monotonic() + 1.0
    while region.load("req_tail") != 5:
        assert time.monotonic() < deadline, "the idle loop did not notice req_head within 1 s"
        time.sleep(0.0001)
    time.sleep(0.05)
    assert loop.running()
    t0 = time.monotonic()
    loop.stop(timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0
    # One at launch (the idle poll ends an iteration, it does not open one), one for the record, one
    # to see shutdown.
    assert int(iterations.item()) == 3
    loop.close()


# -- GPU: the real engine iteration (LoopStep) inside the DeviceLoop ---------------------------------
LOOP_RING = dict(
    request_slots=8, arena_tokens=1024, max_prompt_tokens=64, max_inflight=8, max_output_tokens=32
)
LOOP_ENGINE = dict(
    block_size=4, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48
)
# (name, submitted after the first request's n-th token (0: at once), prompt length, max_tokens)
LOOP_WORKLOAD = [
    ("short", 0, 5, 12),
    ("chunked", 0, 21, 8),  # more than one step's token budget: prefilled in chunks
    ("single", 0, 3, 1),
    ("late", 2, 9, 10),  # arrives while the others decode
    ("later", 4, 14, 6),
]


def _loop_prompt(i: int, length: int) -> list[int]:
    return [(i * 37 + j * 11) % 500 + 3 for j in range(length)]


def _loop_geometry(max_stop_ids: int):
    from blink_appliance.engine.loop.state import LoopGeometry

    return LoopGeometry(
        num_slots=6, buckets=(4, 16), max_stop_ids=max_stop_ids, vocab_size=512, eos_token_ids=(2,),
        **{k: LOOP_ENGINE[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_model_len")},
    )  # fmt: skip


def _serve_workload(host_steps: bool) -> dict[str, list[int]]:
    """Build LoopStep on the GPU over a mapped shm ring; serve LOOP_WORKLOAD through EngineClient either
    with the DeviceLoop launched once, or with host_step() calls; the greedy streams by name."""
    import asyncio
    import os

    from blink_appliance.engine.loop.control import LoopControl
    from blink_appliance.engine.loop.graph import DeviceLoop
    from blink_appliance.engine.loop.mapped_region import MappedRegion, RingWords
    from blink_appliance.engine.loop.step import LoopStep
    from blink_appliance.model.gpu_weights import GpuWeights
    from blink_appliance.model.loaders import load_checkpoint
    from blink_appliance.wire.client import EngineClient
    from blink_appliance.wire.region import RingRegion
    from blink_appliance.wire.request import FinishReason, SamplingParams
    from blink_appliance.wire.ring_layout import EngineState, RingGeometry, RingLayout, region_size
    from blink_appliance.wire.shm_transport import ShmTransport

    ring_geometry = RingGeometry(**LOOP_RING)
    ckpt = load_checkpoint("dummy:tiny", seed=0)
    device = torch.device("cuda", torch.cuda.current_device())
    transport = ShmTransport.create(f"blink-test-engine-loop-{os.getpid()}", region_size(ring_geometry))
    region = RingRegion.create(transport, ring_geometry)
    mapped = MappedRegion.of_transport(transport, device)
    words = RingWords.of(mapped)
    loop = None
    try:
        step = LoopStep.build(
            ckpt.config, GpuWeights.from_hf(ckpt.config, ckpt.weights, torch.float32, device),
            mapped.tensor(0, torch.uint8, mapped.size), RingLayout.of(ring_geometry),
            _loop_geometry(ring_geometry.max_stop_ids), device, torch.float32, engine_seed=7,
        )  # fmt: skip
        step.warmup()
        if not host_steps:
            loop = DeviceLoop(
                step.body(), num_active=step.state.num_active, keep_running=step.state.keep_running,
                ring=words, control=LoopControl(device),
            )  # fmt: skip
        region.store("engine_heartbeat_ns", time.monotonic_ns())
        region.store("engine_state", EngineState.RUNNING)
        if loop is not None:
            loop.launch()

        async def serve() -> dict[str, list]:
            client = EngineClient.attach(transport, ring_geometry, stall_limit_s=600.0)
            await client.start()
            streams: dict[str, list] = {}
            tasks = []

            async def collect(rid: int, into: list) -> None:
                async for event in client.stream(rid):
                    into.append(event)

            def submit(name: str, length: int, max_tokens: int) -> None:
                i = [w[0] for w in LOOP_WORKLOAD].index(name)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                streams[name] = []
                rid = client.submit(_loop_prompt(i, length), params)
                tasks.append(asyncio.create_task(collect(rid, streams[name])))

            pending = list(LOOP_WORKLOAD)
            deadline = time.monotonic() + 60
            while pending or not all(t.done() for t in tasks):
                assert time.monotonic() < deadline, f"workload not done: {streams}"
                region.store("engine_heartbeat_ns", time.monotonic_ns())  # the engine host thread's job
                first = len(streams.get(LOOP_WORKLOAD[0][0], []))
                for w in [w for w in pending if w[1] <= first]:
                    submit(w[0], w[2], w[3])
                    pending.remove(w)
                if host_steps:
                    step.host_step()
                if loop is not None:
                    assert loop.running(), "the device loop ended early"
                await asyncio.sleep(0.0002)
            await client.close()
            return streams

        streams = asyncio.run(serve())
        if loop is not None:
            t0 = time.monotonic()
            loop.stop(timeout_s=1.0)
            assert time.monotonic() - t0 < 1.0
        for name, events in streams.items():
            assert sum(e.finished for e in events) == 1 and events[-1].finish_reason is FinishReason.LENGTH, (
                name
            )
        assert int(step.state.num_active.item()) == 0
        assert int(step.state.free_top.item()) == LOOP_ENGINE["num_kv_blocks"]  # every block came back
        return {name: [e.token_id for e in ev if e.token_id is not None] for name, ev in streams.items()}
    finally:
        if loop is not None:
            words.request_shutdown()
            if not loop.join(timeout_s=5.0):  # leave the mapping alone: the loop may still read it
                raise RuntimeError("the device loop did not stop; not unmapping the ring under it")
            loop.close()
        torch.cuda.synchronize()
        mapped.close()
        transport.close()


@gpu
@needs_gpu
@pytest.mark.skipif(
    importlib.util.find_spec("blink_appliance.engine.loop.step") is None, reason="LoopStep not present"
)
def test_engine_loop_greedy_streams_equal_host_steps_and_the_reference_engine():
    from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
    from blink_appliance.model.loaders import build_model, load_checkpoint
    from blink_appliance.wire.request import Request, SamplingParams

    model = build_model(load_checkpoint("dummy:tiny", seed=0), torch.float32, "cpu")
    reference = {}
    for i, (name, _, length, max_tokens) in enumerate(LOOP_WORKLOAD):
        engine = LLMEngine(model, EngineConfig(seed=0, **LOOP_ENGINE))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reference[name] = engine.generate([Request(0, _loop_prompt(i, length), params)])[0]

    in_loop = _serve_workload(host_steps=False)
    by_host = _serve_workload(host_steps=True)
    assert in_loop == reference, f"device loop {in_loop} vs reference {reference}"
    assert by_host == reference, f"host steps {by_host} vs reference {reference}"

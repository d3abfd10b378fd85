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

from blink_appliance.engine.device_loop import (
    CaptureStep,
    RawGraph,
    SetSwitch,
    SetWhile,
    Switch,
    SwitchStep,
    engine_body,
    plan_body,
)
from blink_appliance.engine.loop_control import KERNELS, Backoff, kernel_source

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
def test_plan_puts_setters_before_each_switch_and_set_while_last():
    def a() -> None: ...

    def b() -> None: ...

    def c() -> None: ...

    s1 = Switch("bucket", _i32(), [[RawGraph(1)], [RawGraph(2)]])
    s2 = Switch("sampler", _i32(), [[a], [b]])
    plan = plan_body([a, b, s1, s2, c])
    assert plan.switches == [s1, s2]
    assert plan.steps == [
        CaptureStep([a, b, SetSwitch(0)]),
        SwitchStep(0),
        CaptureStep([SetSwitch(1)]),  # a switch right after a switch gets a capture of its setter
        SwitchStep(1),
        CaptureStep([c, SetWhile()]),
    ]
    # A body ending in a switch still ends with a capture holding set_while.
    assert plan_body([s1]).steps == [CaptureStep([SetSwitch(0)]), SwitchStep(0), CaptureStep([SetWhile()])]


def test_engine_body_is_schedule_bucket_switch_sampler_switch_commit():
    class Buckets:  # the part of ForwardGraphs the body uses
        buckets = (8, 32, 128)

        def raw_cuda_graph(self, num_tokens: int) -> int:
            return 1000 + num_tokens

    def schedule() -> None: ...

    def greedy() -> None: ...

    def full() -> None: ...

    def commit() -> None: ...

    bucket_index, sampler_index = _i32(), _i32()
    body = engine_body(
        bucket_index=bucket_index, sampler_index=sampler_index, forward=Buckets(),
        schedule=schedule, sample_greedy=greedy, sample_full=full, commit=commit,
    )  # fmt: skip
    assert body[0] is schedule and body[3] is commit
    bucket, sampler = body[1], body[2]
    assert bucket.value is bucket_index and sampler.value is sampler_index
    assert [list(b) for b in bucket.branches] == [[RawGraph(1008)], [RawGraph(1032)], [RawGraph(1128)]]
    assert [list(b) for b in sampler.branches] == [[greedy], [full]]
    steps = plan_body(body).steps
    assert steps[0] == CaptureStep([schedule, SetSwitch(0)]) and steps[-1] == CaptureStep(
        [commit, SetWhile()]
    )


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

    from blink_appliance.transport.mapped_region import MappedRegion

    with pytest.raises(ValueError, match="CUDA device"):
        MappedRegion(np.zeros(64, dtype=np.uint8), "cpu")


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def ring():
    """A small shared-memory ring, mapped into the GPU: (RingRegion, RingWords)."""
    import os

    from blink_appliance.transport.mapped_region import MappedRegion, RingWords
    from blink_appliance.transport.region import RingRegion
    from blink_appliance.transport.ring_layout import RingGeometry, region_size
    from blink_appliance.transport.shm_transport import ShmTransport

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
    from blink_appliance.engine.loop_control import LoopControl

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
    from blink_appliance.engine.device_loop import DeviceLoop

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
    from blink_appliance.engine.cuda_graphs import ForwardGraphs
    from blink_appliance.engine.device_loop import DeviceLoop
    from blink_appliance.model.gpu_forward import GpuForward, GpuWeights
    from blink_appliance.model.kv_cache import PagedKVCache
    from blink_appliance.model.loaders.dummy import preset_config
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
    branch_runs = torch.zeros(4, dtype=torch.int64, device="cuda")  # bucket 8, bucket 32, greedy, "full"
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
    from blink_appliance.engine.device_loop import DeviceLoop

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
    assert int(iterations.item()) == 2  # one for the record, one to see shutdown
    loop.close()

"""Phase 3 of bench/device_loop_check.py: the real forward as the device loop's SWITCH branch vs the
same bucket graph replayed from the host. `dummy:smollm2-135m` bf16, a 4-sequence decode step in
bucket 8, with a stand-in schedule/commit around it; the loop's logits must equal the replay's. Then
shutdown while busy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads in the functions only, as in device_loop_check.py
    import torch

    from bench.device_loop_check import Rig
    from blink_appliance.engine.loop.forward_graphs import ForwardGraphs
    from blink_appliance.engine.loop.graph import DeviceLoop
    from blink_appliance.model.gpu_forward import GpuForward

N_STEPS = 1000  # forward steps per timed run


@dataclass
class DecodeStep:
    """smollm2-135m bf16 with captured bucket graphs, prefilled; a 4-sequence decode step loaded in
    bucket 8, and the logits its host replay gave."""

    fwd: GpuForward
    graphs: ForwardGraphs
    rows: int  # sampled rows of the decode step
    want: torch.Tensor

    @classmethod
    def build(cls, dev: torch.device) -> DecodeStep:
        import torch

        from blink_appliance.engine.loop.forward_graphs import ForwardGraphs
        from blink_appliance.model.gpu_forward import GpuForward
        from blink_appliance.model.gpu_weights import GpuWeights
        from blink_appliance.model.kv_cache import PagedKVCache
        from blink_appliance.model.presets import preset_config
        from tests.model_helpers import PagedSequences

        cfg = preset_config("smollm2-135m")
        block, nblocks, max_blocks = 16, 256, 16
        kv = PagedKVCache.allocate(
            cfg.num_layers, nblocks, block, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev
        )
        fwd = GpuForward(
            cfg, GpuWeights.random(cfg, torch.bfloat16, dev, seed=1), kv,
            max_tokens=128, max_seqs=8, max_blocks_per_seq=max_blocks,
        )  # fmt: skip
        graphs = ForwardGraphs(fwd, (8, 128))
        graphs.capture()
        seqs = PagedSequences(nblocks, block, max_blocks, seed=3)
        prompts = [(s, [(s * 31 + i * 7) % cfg.vocab_size for i in range(25 + 3 * s)]) for s in range(4)]
        prefill = seqs.batch(prompts)
        fwd.load_batch(prefill, 128)
        graphs.replay(128)
        decode = seqs.batch([(s, [100 + s]) for s in range(4)])
        R = decode.sample_rows.shape[0]
        fwd.load_batch(decode, 8)
        want = graphs.replay(8)[:R].clone()
        return cls(fwd, graphs, R, want)


def host_replay_ms(step: DecodeStep) -> float:
    """Milliseconds per step of the bucket-8 graph replayed from the host."""
    import torch

    g8 = step.graphs.graphs[8]
    for _ in range(20):
        g8.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(N_STEPS):
        g8.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / N_STEPS


def forward_loop(rig: Rig, step: DecodeStep, n: int) -> tuple[DeviceLoop, torch.Tensor]:
    """The step as the loop's SWITCH branch, with a stand-in schedule and commit around it and a
    greedy sampler branch; runs n iterations or until shutdown. Returns the loop and its counter."""
    import torch

    from blink_appliance.engine.loop.graph import DeviceLoop, RawGraph, Switch

    words, graphs, R = rig.words, step.graphs, step.rows
    it = torch.zeros(1, dtype=torch.int64, device=rig.dev)
    keep, bucket_index, sampler_index = rig.i32(1), rig.i32(0), rig.i32(0)
    sampled = torch.zeros(R, dtype=torch.int64, device=rig.dev)

    def schedule() -> None:  # stand-in: always the decode step in bucket 8, greedy
        bucket_index.fill_(0)
        sampler_index.fill_(0)

    def commit() -> None:
        it.add_(1)
        keep.copy_((it < n) & (words.shutdown == 0))

    body = [
        schedule,
        Switch("bucket", bucket_index, [[RawGraph(graphs.raw_cuda_graph(T))] for T in graphs.buckets]),
        Switch("sampler", sampler_index, [[lambda: sampled.copy_(step.fwd.logits[:R].argmax(-1))]]),
        commit,
    ]
    return DeviceLoop(body, num_active=rig.i32(1), keep_running=keep, ring=words, control=rig.control), it


def minimal_forward_loop(rig: Rig, step: DecodeStep, n: int) -> DeviceLoop:
    """Only the bucket-8 SWITCH and a counter: n iterations."""
    import torch

    from blink_appliance.engine.loop.graph import DeviceLoop, RawGraph, Switch

    it = torch.zeros(1, dtype=torch.int64, device=rig.dev)
    keep, bucket_index = rig.i32(1), rig.i32(0)

    def count() -> None:
        it.add_(1)
        keep.copy_(it < n)

    body = [Switch("bucket", bucket_index, [[RawGraph(step.graphs.raw_cuda_graph(8))]]), count]
    return DeviceLoop(body, num_active=rig.i32(1), keep_running=keep, ring=rig.words, control=rig.control)


def minimal_loop_ms(rig: Rig, step: DecodeStep) -> float:
    """Milliseconds per iteration of `minimal_forward_loop`."""
    minimal_ms = {}
    for n in (10, 1, N_STEPS + 1):
        loop = minimal_forward_loop(rig, step, n)
        t0 = time.perf_counter()
        loop.launch()
        assert loop.join(timeout_s=60)
        minimal_ms[n] = (time.perf_counter() - t0) * 1e3
        loop.close()
    per_step_ms = (minimal_ms[N_STEPS + 1] - minimal_ms[1]) / N_STEPS
    print(f"[3] minimal loop (wait, SWITCH -> bucket 8, count, set_while): {per_step_ms * 1e3:.1f} us/step")
    return per_step_ms


def forward_in_loop(rig: Rig, step: DecodeStep, replay_ms: float, minimal_ms: float) -> dict[str, Any]:
    """The step run N_STEPS times in the loop: time per step, and its logits vs the host replay's."""
    import torch

    loop, it = forward_loop(rig, step, 10)
    loop.launch()
    assert loop.join(timeout_s=30)
    loop.close()
    loop, it = forward_loop(rig, step, N_STEPS)
    step.fwd.logits.zero_()
    t0 = time.perf_counter()
    loop.launch()
    assert loop.join(timeout_s=60)
    loop_ms = (time.perf_counter() - t0) * 1e3 / N_STEPS
    loop.close()
    got = step.fwd.logits[: step.rows]
    logits_equal = bool(torch.equal(got, step.want))
    print(
        f"[3] smollm2-135m bf16 decode x4, bucket 8: host replay {replay_ms * 1e3:.1f} us/step, "
        f"in the loop {loop_ms * 1e3:.1f} us/step (+{(loop_ms - replay_ms) * 1e3:.1f}); "
        f"logits equal to replay: {logits_equal}"
    )
    return {
        "model": "dummy:smollm2-135m bf16",
        "step": "4 decodes, bucket 8",
        "host_replay_us": replay_ms * 1e3,
        "loop_us": loop_ms * 1e3,
        "loop_minus_replay_us": (loop_ms - replay_ms) * 1e3,
        "minimal_loop_us": minimal_ms * 1e3,
        "logits_equal_to_replay": logits_equal,
        "iterations": int(it.item()),
    }


def busy_shutdown_ms(rig: Rig, step: DecodeStep) -> float:
    """Milliseconds from the shutdown write to the loop's end while it runs the forward."""
    loop, it = forward_loop(rig, step, 2**62)
    loop.launch()
    time.sleep(0.3)
    t0 = time.perf_counter()
    loop.stop(timeout_s=1.0)
    busy_stop_ms = (time.perf_counter() - t0) * 1e3
    loop.close()
    rig.reset_ring()
    print(
        f"[3] shutdown while busy (after {int(it.item())} steps): loop ended {busy_stop_ms:.2f} ms after the write"
    )
    return busy_stop_ms

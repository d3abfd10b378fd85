"""Tensor parallelism over two ranks (model/tensor_parallel.py): the sharded forward against the
reference model.

Without a GPU the two ranks run in two forked processes under Triton's interpreter; the buffers a
rank reads of its peer's (O's and down's shares, the flags) are moved to shared memory before the
fork, so each process reads the other's as a GPU reads its peer's over NVLink. With two GPUs the
same runs compiled, one process driving both.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.launch_plans import deterministic_gemms  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.model.tensor_parallel import (  # noqa: E402
    check_shardable,
    connect,
    shard_config,
    shard_weights,
    warm_alone,
)
from tests.model_helpers import PagedSequences  # noqa: E402
from tests.test_gpu_forward import STEPS, _to  # noqa: E402

GPUS = torch.cuda.device_count()
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, MAX_SEQS, BUCKET = 4, 64, 12, 6, 32
# The steps of test_gpu_forward, then a decode-only one in the 8-token bucket (fp32 split-K partials),
# then batch 1 in the 1-token bucket (its own attention plan: RoPE fused, keys split).
DECODE = [(s, [40 + s]) for s in range(5)]
SOLO = [(2, [77])]


def _kv(config, device):
    return PagedKVCache.allocate(
        config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32, device
    )


def _rank_forward(config, weights, rank, device):
    local = shard_config(config, 2)
    return GpuForward(
        local, shard_weights(weights, config, rank, 2, device), _kv(local, device), max_tokens=BUCKET,
        max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS, gemm_plan=deterministic_gemms, tp_rank=rank,
    )  # fmt: skip


def _batches():
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, seed=11)
    return [(seqs.batch(chunks), BUCKET) for chunks in STEPS] + [
        (seqs.batch(DECODE), 8),
        (seqs.batch(SOLO), 1),
    ]


def _run(fwd, batches):
    """Every step of one rank: (logits, residual stream) per step, on the CPU."""
    out = []
    for batch, bucket in batches:
        fwd.load_batch(batch, bucket)
        logits = fwd.step(bucket)
        out.append(
            (
                logits[: batch.sample_rows.shape[0]].cpu().clone(),
                fwd._residual[: batch.num_tokens].cpu().clone(),
            )
        )
    return out


def _reference(ckpt, batches):
    model = build_model(ckpt, torch.float32, "cpu")
    kv = _kv(ckpt.config, "cpu")
    return [model(_to(batch, "cpu"), kv) for batch, _ in batches]


def _child(fwd, batches, queue):
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive the fork
    try:
        # numpy, not tensors: torch would pass tensors as handles to memory that dies with the child
        queue.put((fwd.tp.rank, [(a.numpy(), b.numpy()) for a, b in _run(fwd, batches)]))
    except BaseException as e:  # reported to the parent, which fails the test with it
        queue.put((fwd.tp.rank, repr(e)))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness: two forked ranks under the interpreter")
def test_two_ranks_match_the_reference_and_keep_the_same_stream(preset):
    ckpt = load_checkpoint(f"dummy:{preset}", seed=3)
    cfg = ckpt.config
    weights = GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, "cpu")
    ranks = [_rank_forward(cfg, weights, r, "cpu") for r in (0, 1)]
    connect(*ranks)
    for fwd in ranks:  # what the peer reads, at the same pages in both processes after the fork
        for t in (fwd._o_parts, fwd._down_parts, fwd._proj, fwd._proj_mlp, fwd.tp.flags):
            if t is not None:
                t.share_memory_()
    batches = _batches()
    want = _reference(ckpt, batches)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fwd, batches, queue), daemon=True) for fwd in ranks]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(not isinstance(v, str) for v in got.values()), got
    for k, (expected, (logits, stream), (_, stream1)) in enumerate(zip(want, got[0], got[1], strict=True)):
        logits, stream, stream1 = (torch.from_numpy(a) for a in (logits, stream, stream1))
        err = ((logits - expected).norm() / expected.norm()).item()
        assert err < 1e-4, f"step {k}: rank 0's logits differ from the reference by {err:.2e}"
        assert torch.equal(stream, stream1), f"step {k}: the ranks' residual streams differ"


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs with peer access")
def test_two_gpus_match_one():
    ckpt = load_checkpoint("dummy:tiny", seed=3)
    cfg = ckpt.config
    weights = GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, "cuda:0")
    ranks = [_rank_forward(cfg, weights, r, f"cuda:{r}") for r in (0, 1)]
    connect(*ranks)
    batches = _batches()
    for bucket in (1, 8, BUCKET):
        warm_alone(ranks, lambda fwd, T=bucket: fwd.step(T))
    want = _reference(ckpt, batches)
    for k, (batch, bucket) in enumerate(batches):
        for fwd in ranks:  # launched on both GPUs before either is waited for
            fwd.load_batch(batch, bucket)
        for fwd in ranks:
            with torch.cuda.device(fwd.device):
                fwd.step(bucket)
        for fwd in ranks:
            torch.cuda.synchronize(fwd.device)
        R, n = batch.sample_rows.shape[0], batch.num_tokens
        logits = ranks[0].logits[:R].cpu()
        err = ((logits - want[k]).norm() / want[k].norm()).item()
        assert err < 1e-4, f"step {k}: rank 0's logits differ from the reference by {err:.2e}"
        assert torch.equal(ranks[0]._residual[:n].cpu(), ranks[1]._residual[:n].cpu())


def test_shapes_that_do_not_split_are_refused():
    cfg = load_checkpoint("dummy:tiny", seed=3).config
    with pytest.raises(ValueError, match="tensor_parallel must be one of"):
        check_shardable(cfg, 4)
    with pytest.raises(ValueError, match="num_kv_heads 3"):
        check_shardable(replace(cfg, num_kv_heads=3, num_heads=6), 2)


def test_a_tensor_parallel_forward_needs_a_plan_without_atomics():
    ckpt = load_checkpoint("dummy:tiny", seed=3)
    cfg = ckpt.config
    local = shard_config(cfg, 2)
    weights = shard_weights(GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, "cpu"), cfg, 0, 2, "cpu")
    with pytest.raises(ValueError, match="without atomics"):
        GpuForward(
            local, weights, _kv(local, "cpu"), max_tokens=8, max_seqs=4, max_blocks_per_seq=4, tp_rank=0
        )


def test_both_ranks_add_rank_0s_share_first_and_flag_the_peer():
    """The shares' sum rounds differently by order: 2^-24 + 2^-24 + 1 is 1 + 2^-23, 1 + 2^-24 + 2^-24
    is 1. Both ranks must get rank 0's order, and each sets its peer's flag to the step's epoch."""
    from blink_appliance.kernels.rmsnorm import PeerShare, add_rmsnorm

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    H = 16
    share0 = torch.zeros(2, 1, H, device=dev)
    share0[0] = 1.0
    share1 = torch.full((2, 1, H), 2.0**-24, device=dev)
    flags = [torch.zeros(3, dtype=torch.int32, device=dev) for _ in range(2)]
    epoch = torch.tensor([5], dtype=torch.int32, device=dev)
    for f in flags:
        f[1] = 5  # the peer has flagged point 1 in this step already: no wait
    streams = []
    for rank, (mine, theirs) in enumerate([(share0, share1), (share1, share0)]):
        h = torch.zeros(1, H, device=dev)
        out = torch.empty(1, H, device=dev)
        peer = PeerShare(rank, theirs, flags[rank], flags[1 - rank], epoch, point=1)
        add_rmsnorm(mine, torch.ones(H, device=dev), out, 1e-6, residual=h, x_parts=2, peer=peer)
        streams.append(h.cpu())
    assert torch.equal(streams[0], streams[1]) and (streams[0] == 1.0).all()
    assert [f.tolist() for f in flags] == [[0, 5, 0], [0, 5, 0]]


@pytest.mark.skipif(
    torch.cuda.is_available() and GPUS < 2,
    reason="needs two GPUs with peer access (or none: the interpreter)",
)
def test_a_rank_warms_up_alone_and_leaves_the_flags_at_zero():
    """warm_alone runs each rank by itself (it would wait forever on a peer that is not running)."""
    import threading

    ckpt = load_checkpoint("dummy:tiny", seed=3)
    home = "cuda:0" if GPUS else "cpu"
    weights = GpuWeights.from_hf(ckpt.config, ckpt.weights, torch.float32, home)
    ranks = [_rank_forward(ckpt.config, weights, r, f"cuda:{r}" if GPUS else "cpu") for r in (0, 1)]
    connect(*ranks)
    done, failed = threading.Event(), []

    def warm() -> None:
        try:
            warm_alone(ranks, lambda fwd: fwd.step(8))
        except BaseException as e:  # reported by the test, not lost with the thread
            failed.append(e)
        done.set()

    threading.Thread(target=warm, daemon=True).start()
    assert done.wait(300), "a rank warming up alone waited for its peer"
    assert not failed, failed
    assert all(not f.tp.solo and int(f.tp.epoch) == 0 and not f.tp.flags.any() for f in ranks)

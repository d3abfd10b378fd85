"""The fixed-shape forward (Triton kernels + torch GEMMs over static buffers) vs the reference model.

Without a GPU it runs on the CPU with the kernels under Triton's interpreter, fp32, and must match
LlamaModel.forward to < 1e-4 relative error over several steps of mixed prefill and decode (the KV
cache it writes is checked too). With a GPU the same runs compiled, and the captured CUDA graphs are
checked against eager steps and the reference.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.launch_plans import attention_config, decode_gemms, deterministic_gemms  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from tests.model_helpers import PagedSequences  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, MAX_SEQS = 4, 64, 12, 6

# Three steps: prefills; a mix of new prefills, a chunk continuing a prompt and decodes; decodes + one
# long prefill that spans many blocks. Odd lengths throughout; seq 3 starts its prompt in step 2.
STEPS = [
    [(0, [5, 17, 33, 2, 9, 100, 7]), (1, [44, 3, 8]), (2, list(range(10, 23)))],
    [(0, [71]), (3, [6, 6, 6, 6, 6]), (1, [301]), (2, [19, 18, 17, 16, 15, 14])],
    [(2, [400]), (0, [9]), (3, [12]), (4, [(i * 37) % 500 for i in range(25)]), (1, [3])],
]
BUCKET = 32


def _fresh_kv(config, dtype, device):
    kv = PagedKVCache.allocate(
        config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype, device
    )
    return kv


@pytest.mark.parametrize(
    "preset,triton_gemm_max_tokens,bucket,accumulate,fused_rope",
    # (128, 32): every projection through the Triton GEMM (all rows in one tile, QKV's split-K partials
    # summed by RoPE, O and down adding into the residual stream); (0, 32): cuBLAS for every projection;
    # (128, 72): the gate+up GEMM writes silu(gate)*up itself; accumulate False: O and down write
    # split-K partials that the norms sum. fused_rope: the attention does RoPE and the cache write
    # (True) or the RoPE kernel does (None: the plan's default, False at 32); Qwen3 keeps the kernel anyway.
    [
        ("tiny", 128, 32, True, None),
        ("tiny-qwen2", 128, 32, True, None),
        ("tiny-qwen3", 128, 32, True, None),
        ("tiny", 0, 32, False, None),
        ("tiny", 128, 72, True, None),
        ("tiny", 128, 32, False, None),
        ("tiny", 128, 32, True, True),
        ("tiny-qwen2", 128, 32, True, True),
        ("tiny-qwen3", 128, 32, True, True),
        ("tiny", 0, 72, False, True),
    ],
)
def test_fixed_shape_forward_matches_reference_fp32(
    preset, triton_gemm_max_tokens, bucket, accumulate, fused_rope
):
    ckpt = load_checkpoint(f"dummy:{preset}", seed=3)
    cfg = ckpt.config
    ref_model = build_model(ckpt, torch.float32, DEVICE)
    ref_kv = _fresh_kv(cfg, torch.float32, DEVICE)
    kv = _fresh_kv(cfg, torch.float32, DEVICE)
    fwd = GpuForward(
        cfg, GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, DEVICE), kv,
        max_tokens=bucket, max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS,
        triton_gemm_max_tokens=triton_gemm_max_tokens,
        gemm_plan=decode_gemms if accumulate else deterministic_gemms,
        attention_plan=attention_config if fused_rope is None
        else lambda t, config: replace(attention_config(t, config), fused_rope=fused_rope),
    )  # fmt: skip
    # The bucket really takes the path this case is named for.
    plan = fwd._gemms(bucket)
    triton = [name for name in ("qkv", "o", "gate_up", "down") if getattr(plan, name)]
    assert triton == (["qkv", "o", "gate_up", "down"] if triton_gemm_max_tokens else [])
    assert plan.accumulates == accumulate
    assert plan.silu_in_gate_up == (triton_gemm_max_tokens > 0 and bucket > 64)
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, seed=11)
    for chunks in STEPS:
        batch = seqs.batch(chunks)
        want = ref_model(_to(batch, DEVICE), ref_kv)
        _poison(fwd)
        fwd.load_batch(batch, bucket)
        got = fwd.step(bucket)
        R = batch.sample_rows.shape[0]
        assert torch.isfinite(got).all()
        err = ((got[:R] - want).norm() / want.norm()).item()
        assert err < 1e-4, f"step logits differ: relative error {err:.2e}"
        assert (got[R:] == 0).all(), "unused sample rows must give zero logits"
        written = batch.slot_mapping
        for name in ("k", "v"):
            a = getattr(kv, name).flatten(1, 2)[:, written]
            b = getattr(ref_kv, name).flatten(1, 2)[:, written]
            assert ((a - b).norm() / b.norm()).item() < 1e-5, f"{name} cache differs"

    # A decode-only step in a small bucket: the few-row path (split-K O/down GEMMs adding into the
    # stream or writing partials the norms sum, silu(gate)*up from the gate+up GEMM), or cuBLAS.
    batch = seqs.batch([(s, [40 + s]) for s in range(5)])
    want = ref_model(_to(batch, DEVICE), ref_kv)
    _poison(fwd)
    fwd.load_batch(batch, 8)
    got = fwd.step(8)
    err = ((got[:5] - want).norm() / want.norm()).item()
    assert err < 1e-4, f"decode bucket logits differ: relative error {err:.2e}"
    assert (got[5:8] == 0).all()


def _poison(fwd: GpuForward) -> None:
    """NaN into every activation buffer and the logits: anything read before written shows."""
    for value in vars(fwd).values():
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value is not fwd.cos
            and value is not fwd.sin
        ):
            value.fill_(float("nan"))


def _to(batch, device):
    from dataclasses import fields

    return replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in fields(batch)})


def test_decode_step_with_silu_in_the_down_gemm_matches_reference():
    """The plan before 2026-11-28 (forward_levers' silud16 lever): up to 16 tokens down computes
    silu(gate) * up in its prologue from the gate+up GEMM's output."""
    ckpt = load_checkpoint("dummy:tiny", seed=3)
    cfg = ckpt.config
    ref_model = build_model(ckpt, torch.float32, DEVICE)
    ref_kv, kv = _fresh_kv(cfg, torch.float32, DEVICE), _fresh_kv(cfg, torch.float32, DEVICE)

    def plan(t: int, config=None):
        return replace(decode_gemms(t, config), silu_in_down=True, silu_in_gate_up=False)

    fwd = GpuForward(
        cfg, GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, DEVICE), kv,
        max_tokens=8, max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS, gemm_plan=plan,
    )  # fmt: skip
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, seed=11)
    for chunks in ([(s, [3 + s, 9]) for s in range(4)], [(s, [20 + s]) for s in range(4)]):
        batch = seqs.batch(chunks)
        want = ref_model(_to(batch, DEVICE), ref_kv)
        _poison(fwd)
        fwd.load_batch(batch, 8)
        got = fwd.step(8)[: batch.sample_rows.shape[0]]
        assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize(
    "steps",
    [
        # batch 1: decodes in the 1-token bucket after a 40-token prompt, across a block boundary
        # and into a second split
        [(40, [(0, [(7 * j) % 300 for j in range(40)])])] + [(1, [(0, [t])]) for t in (41, 42, 43, 44)],
        # the 4-token bucket: two sequences' decodes (half the rows padding), then a 2-token chunk
        # beside a decode
        [(40, [(0, [(5 * j) % 300 for j in range(17)]), (1, [(3 * j) % 290 for j in range(20)])])]
        + [(4, [(0, [50 + t]), (1, [60 + t])]) for t in range(3)]
        + [(4, [(0, [70, 71]), (1, [72])])],
    ],
    ids=["bucket1", "bucket4"],
)
def test_small_buckets_fuse_rope_and_match_reference(steps):
    """The 1- to 4-token buckets' attention plan (RoPE and the cache write in the attention, keys
    split 16 or 32 ways, split-K QKV partials summed as q and k are read): each step reads the keys the one
    before wrote; the cache must hold what the reference writes."""
    ckpt = load_checkpoint("dummy:tiny", seed=3)
    cfg = ckpt.config
    ref_model = build_model(ckpt, torch.float32, DEVICE)
    ref_kv, kv = _fresh_kv(cfg, torch.float32, DEVICE), _fresh_kv(cfg, torch.float32, DEVICE)
    fwd = GpuForward(
        cfg, GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, DEVICE), kv,
        max_tokens=40, max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS,
    )  # fmt: skip
    small = steps[-1][0]
    plan = fwd.attention_plan(small, cfg)
    assert plan.fused_rope and plan.splits > 1 and fwd._gemms(small).qkv.split_k > 1
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, seed=11)
    for bucket, chunks in steps:
        batch = seqs.batch(chunks)
        want = ref_model(_to(batch, DEVICE), ref_kv)
        _poison(fwd)
        fwd.load_batch(batch, bucket)
        got = fwd.step(bucket)[: len(chunks)]
        assert ((got - want).norm() / want.norm()).item() < 1e-4, f"bucket {bucket}"
    for name in ("k", "v"):  # both start as zeros: the whole cache, unwritten slots included
        a, b = getattr(kv, name), getattr(ref_kv, name)
        assert ((a - b).norm() / b.norm()).item() < 1e-5, f"{name} cache differs"


def test_load_batch_refuses_what_does_not_fit():
    ckpt = load_checkpoint("dummy:tiny")
    cfg = ckpt.config
    kv = _fresh_kv(cfg, torch.float32, DEVICE)
    fwd = GpuForward(
        cfg, GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, DEVICE), kv,
        max_tokens=8, max_seqs=2, max_blocks_per_seq=MAX_BLOCKS,
    )  # fmt: skip
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS)
    with pytest.raises(ValueError, match="do not fit bucket"):
        fwd.load_batch(seqs.batch([(0, list(range(9)))]), 8)
    with pytest.raises(ValueError, match="exceed the bucket"):
        fwd.load_batch(seqs.batch([(1, [1]), (2, [1]), (3, [1])]), 8)
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        fwd.step(16)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (8, 32): the 17-64 plan; (8, 72): the mixed steps land in bucket 72, the 65-128 plan (gated gate+up).
@pytest.mark.parametrize("buckets", [(8, BUCKET), (8, 72)])
def test_captured_graphs_match_reference(dtype, buckets):
    from blink_appliance.engine.loop.forward_graphs import ForwardGraphs

    ckpt = load_checkpoint("dummy:smollm2-135m", seed=5)
    cfg = ckpt.config
    # Same weights on both sides: what the bf16 forward holds, upcast for the fp32 reference.
    ckpt = replace(ckpt, weights={k: v.to(dtype).float() for k, v in ckpt.weights.items()})
    ref_model = build_model(ckpt, torch.float32, DEVICE)
    ref_kv = _fresh_kv(cfg, torch.float32, DEVICE)
    kv = _fresh_kv(cfg, dtype, DEVICE)
    fwd = GpuForward(
        cfg, GpuWeights.from_hf(cfg, ckpt.weights, dtype, DEVICE), kv,
        max_tokens=max(buckets), max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS,
    )  # fmt: skip
    graphs = ForwardGraphs(fwd, buckets=buckets)
    graphs.capture()
    assert all(isinstance(graphs.raw_cuda_graph(T), int) and graphs.raw_cuda_graph(T) for T in buckets)
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, seed=11)
    steps = STEPS + [[(0, [1]), (1, [2]), (2, [3]), (3, [4]), (4, [5])]]  # a decode-only step: bucket 8
    for chunks in steps:
        batch = seqs.batch(chunks)
        want = ref_model(_to(batch, DEVICE), ref_kv)
        _poison(fwd)
        T = graphs.bucket_for(batch.num_tokens)
        assert T == (8 if batch.num_tokens <= 8 else buckets[1])
        fwd.load_batch(batch, T)
        got = graphs.replay(T)
        torch.cuda.synchronize()
        R = batch.sample_rows.shape[0]
        assert torch.isfinite(got).all()
        err = ((got[:R] - want).norm() / want.norm()).item()
        # bf16 over 30 random layers: the reference model itself run in bf16 lands ~1.4e-2 from fp32
        # (measured on the CPU); with its fp32 residual stream the forward lands nearer, ~0.8e-2.
        assert err < (1.2e-2 if dtype == torch.bfloat16 else 1e-4), f"bucket {T}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(
    not GPU, reason="atomics run one at a time in the CPU interpreter: only a GPU can reorder them"
)
@pytest.mark.parametrize("bucket", [8, 72])
def test_deterministic_plan_gives_the_same_bits_every_run(bucket):
    """`deterministic_gemms` (profile engine.deterministic): no atomics, so the same step replayed gives
    bit-identical logits (the default plan adds split-K slices in whatever order they finish)."""
    from blink_appliance.engine.loop.forward_graphs import ForwardGraphs

    ckpt = load_checkpoint("dummy:smollm2-135m", seed=5)
    cfg = ckpt.config
    kv = _fresh_kv(cfg, torch.bfloat16, DEVICE)
    fwd = GpuForward(
        cfg, GpuWeights.from_hf(cfg, ckpt.weights, torch.bfloat16, DEVICE), kv,
        max_tokens=bucket, max_seqs=MAX_SEQS, max_blocks_per_seq=MAX_BLOCKS, gemm_plan=deterministic_gemms,
    )  # fmt: skip
    assert not fwd._gemms(bucket).accumulates
    graphs = ForwardGraphs(fwd, buckets=(bucket,))
    graphs.capture()
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, seed=11)
    chunks = [(s, [7 + s] * (1 if bucket == 8 else 12)) for s in range(MAX_SEQS - 1)]
    fwd.load_batch(seqs.batch(chunks), bucket)
    first = graphs.replay(bucket).clone()
    for _ in range(20):  # the cache writes repeat the same slots with the same values
        assert torch.equal(graphs.replay(bucket), first)

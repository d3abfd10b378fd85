"""Per-bucket launch shapes of the fixed-shape forward (model/gpu_forward.py): which projections run
through the swap-AB Triton GEMM (kernels/skinny_gemm.py) and with what tiles, and the paged attention's
tiles, splits and fused RoPE. A plan is a function of the bucket and the model's shapes (None: Llama-3.2-1B's,
which the plans were first tuned on). Tuned on the H100; each plan's docstring cites its measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from blink_appliance.model.config import ModelConfig


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of the paged-attention kernel for one bucket."""

    block_q: int  # query tokens per program (times the GQA group = tile rows)
    block_n: int  # keys per tile
    splits: int  # split-KV factor (1 = no merge kernel)
    num_warps: int
    num_stages: int
    # RoPE and this step's KV-cache write done by the attention itself (kernels/paged_attention.py,
    # FusedRope): one kernel fewer per layer. Models with per-head q/k norms (Qwen3) keep the
    # separate RoPE kernel.
    fused_rope: bool = False


def attention_config(num_tokens: int, config: ModelConfig | None = None) -> AttentionConfig:
    """Per bucket, from H100 sweeps (bench/attention_chain.py: 16 layers' launches in one graph, as the
    step runs them; docs/gpu_forward.md): decode buckets have few programs per layer, so key ranges are
    split to put more loads in flight and small programs (1-2 warps) start faster (T=32: 1 warp, 213 ->
    187 us for 16 layers); from 128 tokens on
    there are programs enough and the merge kernel would cost more than it saves; prefill-heavy buckets
    take 16-token query tiles and 64-key tiles.
    33-128 tokens: the attention does RoPE and the cache write itself (`fused_rope`; 1B T=128
    1.652-1.655 -> 1.638-1.640 ms, bench/results/2026-11-25-h100-forward-fused-rope.md). At 8 and
    32 tokens it measured slower (1-warp programs need more registers for it) or a tie, so those
    keep the RoPE kernel.
    `config` says whether the model norms q and k and how wide its heads are (below); the shapes are
    the same for every model but for the split counts. The 8-token bucket splits keys 16 ways. For
    128-wide heads (8B, batch 1) 4 splits are faster at 256 keys (5.587 -> 5.530 ms) but far slower
    at 4096 (6.040 -> 6.818), and a floor of 64 keys a split (the first splits take a short context,
    the rest end at once) gave nothing (5.595): the idle programs cost what working ones did then
    (bench/results/2026-11-27-h100-b1-launch-plans.md).
    Up to 4 tokens the attention fuses RoPE after all, in 4-warp programs over 32-key tiles: on the
    H200 the 1B step took 0.812 -> 0.806 ms at 256 keys and 0.945 -> 0.896 at 4096 in the 1-token
    bucket, 0.814 -> 0.806 and 0.956 -> 0.897 in the 2-token one, 0.827 -> 0.817 and 0.988 -> 0.955 in
    the 4-token one; 1-warp programs were the slow part of the earlier fused tries. At 8 tokens it
    ties at 256 keys and loses at 4096 (1.109 -> 1.194) (bench/results/2026-11-29-h200-b1-fused-rope.md,
    2026-11-29-h200-small-bucket-attention.md). Models with q/k norms keep the RoPE kernel, so they
    keep the 1-warp shape measured with it.
    A split past the context ends at once and the merge skips it, so most of these buckets take 32
    splits. By graph replay on the H200 the 2- and 4-token buckets of 1B tie within 0-9 µs up to 1024
    keys and gain 20 and 43 µs at 4096; for 128-wide heads (8B) the 1-token bucket gains 13-39 µs at
    1024 keys and 51-132 at 4096, but the 4-token one loses 38-46 µs up to 1024, so it keeps 16
    (bench/results/2026-11-29-h200-attention-idle-splits.md, -attention-splits-small-buckets.md).
    1B's 1-token bucket keeps 16: in the loop at the shipped geometry (256 sequences) 32 splits cost
    10 µs a step at a 128-token prompt (0.784 -> 0.793-0.795 ms), though they gain 28 µs at 4096 keys
    (0.878 -> 0.850; bench/results/2026-11-30-h200-split-merge.md).
    """
    if num_tokens <= 4 and (config is None or not config.qk_norm):
        wide = config is not None and config.head_dim > 64
        if num_tokens == 1:
            splits = 32 if wide else 16
        else:
            splits = 16 if wide else 32
        return AttentionConfig(
            block_q=4, block_n=32, splits=splits, num_warps=4, num_stages=3, fused_rope=True
        )
    if num_tokens <= 8:
        return AttentionConfig(block_q=4, block_n=16, splits=16, num_warps=1, num_stages=3)
    if num_tokens <= 32:
        return AttentionConfig(block_q=4, block_n=32, splits=4, num_warps=1, num_stages=2)
    if num_tokens <= 128:
        return AttentionConfig(block_q=4, block_n=32, splits=1, num_warps=2, num_stages=2, fused_rope=True)
    return AttentionConfig(block_q=16, block_n=64, splits=1, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class GemmLaunch:
    """Launch shape of one swap-AB Triton GEMM (kernels/skinny_gemm.py)."""

    split_k: int = 1  # > 1: fp32 partials, summed by the consumer (add+RMSNorm)
    block_n: int = 64  # weight rows per program (the MMA's M side)
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    # Split-K partials in fp32, or (False) in the weights' dtype: half the bytes, one more rounding.
    fp32_partials: bool = True
    # O and down only: add the product into the fp32 residual stream (split-K slices with atomics), so
    # there are no partials and the norm after it only reads the stream; fp32 adds in varying order.
    accumulate: bool = False

    def kernel_args(self) -> dict:
        """The launch shape as skinny_gemm's keyword arguments."""
        args = asdict(self)
        del args["fp32_partials"]
        return args


@dataclass(frozen=True)
class DecodeGemms:
    """Which projections of a bucket run through the swap-AB Triton GEMM (a launch shape) and which
    through cuBLAS (None). O and down split K into partials that the next add+RMSNorm sums (or add
    into the residual stream themselves, `accumulate`), QKV into partials that RoPE sums, so there is
    no split-K reduce kernel."""

    qkv: GemmLaunch | None = None
    o: GemmLaunch | None = None
    gate_up: GemmLaunch | None = None
    down: GemmLaunch | None = None
    silu_in_down: bool = False  # SiLU*up in the down GEMM's prologue instead of its own kernel
    silu_in_gate_up: bool = False  # the gate+up GEMM writes silu(gate)*up itself (its epilogue)

    def __post_init__(self) -> None:
        if self.silu_in_down and self.down is None:
            raise ValueError("silu_in_down needs the Triton down GEMM")
        if self.silu_in_gate_up and (self.gate_up is None or self.silu_in_down or self.gate_up.split_k > 1):
            raise ValueError("silu_in_gate_up needs the Triton gate+up GEMM unsplit, and not silu_in_down")
        if any(g and g.accumulate for g in (self.qkv, self.gate_up)):
            raise ValueError("only O and down can accumulate into the residual stream")

    @property
    def accumulates(self) -> bool:
        return any(g and g.accumulate for g in (self.o, self.down))


CUBLAS_GEMMS = DecodeGemms()
# Up to this many rows the LM head runs through skinny_gemm: as fast as cuBLAS there (H200 1B T=1
# 0.809 against 0.805 ms, T=8 a tie), and its weights stream through L2 evict-first.
LM_HEAD_TRITON_ROWS = 16


def _split(most: int, width: int | None, block_n: int, programs: int) -> int:
    """Split K until the launch has about `programs` programs, at most `most` ways: a wider
    projection has weight tiles enough to fill the GPU with fewer, longer slices."""
    if width is None:
        return most
    return max(1, min(most, round(programs / -(-width // block_n))))


def _tile(width: int | None, programs: int) -> int:
    """Weight rows a program (64 or 128) that put the launch nearest `programs` programs: one wave
    of full programs beats a second, partial one (8B gate+up at batch 1: 112 programs of 128 rows
    5.350 ms, 224 of 64 rows 5.412)."""
    if width is None:
        return 64
    return min((64, 128), key=lambda rows: abs(-(-width // rows) - programs))


def decode_gemms(num_tokens: int, config: ModelConfig | None = None) -> DecodeGemms:
    """Per bucket, from bench/gemm_chain.py on the H100 (16 launches in one graph, as the step runs them;
    bench/results/2026-11-23-h100-gemm-chain*.json), then checked in the whole step (forward_levers.py,
    bench/results/2026-11-23-h100-forward-gated-gemm.md, 2026-11-23-h100-forward-accumulate.md).
    Prefill-sized buckets are compute-bound and take cuBLAS.

    O and down add their products into the fp32 residual stream (`accumulate`, split-K slices with
    atomics): no partials to write, and the norm after each reads only the stream (1B: T=8 1.199 ->
    1.153 ms, T=128 1.710 -> 1.673; O at 65-128 tokens moves off cuBLAS with it).
    Up to 16 tokens everything is Triton and the gate+up GEMM writes silu(gate)*up itself, in tiles
    that give about 128 programs (`_tile`); down splits 8 ways there. Before, down computed the SiLU in
    its prologue: an input that passes through registers on its way to the MMA slows the K loop (down
    0.220 -> 0.208 ms of the 1B step; batch 1: 1B 1.069 -> 1.044-1.055 ms, 8B 5.444 -> 5.357-5.367;
    through HTTP 1.143 -> 1.125 and 5.540 -> 5.453 ms, bench/results/2026-11-28-h100-gated-gate-up.md).
    From 17 tokens on all rows sit in one 8-warp tile (weights read once), QKV splits K in two (RoPE sums
    the halves, kept in the weights' dtype: half the bytes of fp32) and QKV and O take 128-deep K tiles.
    17-64 tokens: SiLU in its own kernel (the gated gate+up GEMM measured slower here: 1.376 -> 1.393 ms
    at T=32). 65-128 tokens: the gate+up GEMM writes silu(gate)*up itself (no activation kernel, 1B
    T=128 1.806 -> 1.753 ms).
    Up to 16 tokens down takes 128-row weight tiles, and QKV, O
    and down split K until a launch has about 192, 128 and 128 programs: 4, 4 and 8 ways for 1B, 2, 2
    and 4 for 8B (batch 1, 256 keys: 1B 1.109 -> 1.092 ms, 8B 5.707 -> 5.597; 8B at 4096 keys 6.167 ->
    6.052; bench/results/2026-11-27-h100-b1-launch-plans.md)."""
    qkv_width = config.q_size + 2 * config.kv_size if config else None
    hidden = config.hidden_size if config else None
    if num_tokens <= 16:
        return DecodeGemms(
            qkv=GemmLaunch(split_k=_split(4, qkv_width, 64, 192), block_k=64),
            o=GemmLaunch(split_k=_split(4, hidden, 64, 128), accumulate=True),
            gate_up=GemmLaunch(block_n=_tile(config.intermediate_size if config else None, 128), block_k=64),
            down=GemmLaunch(split_k=_split(8, hidden, 128, 128), block_n=128, accumulate=True),
            silu_in_gate_up=True,
        )
    if num_tokens > 128:
        return CUBLAS_GEMMS
    return DecodeGemms(
        qkv=GemmLaunch(split_k=2, block_k=128, num_warps=8, fp32_partials=False),
        o=GemmLaunch(split_k=4, block_k=128, num_warps=8, accumulate=True),
        gate_up=GemmLaunch(block_k=64, num_warps=8),
        down=GemmLaunch(split_k=4, block_k=128, num_warps=8, accumulate=True),
        silu_in_gate_up=num_tokens > 64,
    )


def deterministic_gemms(num_tokens: int, config: ModelConfig | None = None) -> DecodeGemms:
    """`decode_gemms` without atomics: O and down write split-K partials that the next norm sums in a
    fixed order (fp32 up to 16 tokens, the weights' dtype above; O on cuBLAS at 65-128 tokens, where
    its partials cost more than cuBLAS), so the same step gives the same bits every run. 1B on the
    H100: T=8 1.127 -> 1.182 ms, T=128 1.652 -> 1.706 (bench/results/2026-11-23-h100-forward-accumulate.md)."""
    g = decode_gemms(num_tokens, config)
    if not g.accumulates:
        return g
    small = num_tokens <= 16
    o = replace(g.o, accumulate=False, fp32_partials=small) if num_tokens <= 64 else None
    return replace(g, o=o, down=replace(g.down, accumulate=False, fp32_partials=small))

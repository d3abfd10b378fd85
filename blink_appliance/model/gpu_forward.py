"""The fixed-shape forward pass: Triton kernels + cuBLAS GEMMs over static device buffers.

Everything a step reads lives in preallocated tensors (`StepInputs`), sized once for the largest
token bucket and `max_seqs`; a step over bucket T reads their first T rows. A step does no `.item()`,
no host sync and no allocation, so it can be captured in a CUDA graph (engine/cuda_graphs.py) and
replayed by the device-resident loop, which writes the inputs and reads `logits`.

Per layer: add+RMSNorm (Triton) -> fused QKV GEMM (+bias) -> RoPE + KV-cache write (Triton) ->
paged attention (Triton) -> O GEMM -> add+RMSNorm -> fused gate+up GEMM -> SiLU*up (Triton) -> down
GEMM. The first layer's norm gathers the token embeddings itself. GEMMs run through cuBLAS, except in
decode-sized buckets (<= 128 tokens by default), where all four run through the swap-AB Triton GEMM
(`decode_gemms`): QKV's split-K partials are summed by RoPE, and O and down add their products into
the fp32 residual stream themselves (atomics; `deterministic_gemms` writes partials instead, summed
by the next norm); SiLU*up moves into the down GEMM's prologue up to 16 tokens and into the gate+up
GEMM's epilogue at 65-128.
The final norm and the LM head run only on the `sample_rows` gather (a fixed number of rows per
bucket, min(T, max_seqs); unused entries are -1 and give zero logits).

It computes the same function as the reference model in llama.py (the tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from blink_appliance.kernels.activation import silu_and_mul
from blink_appliance.kernels.paged_attention import FusedRope, paged_attention, split_partials
from blink_appliance.kernels.rmsnorm import add_rmsnorm
from blink_appliance.kernels.rope import rope_and_cache_write, rope_tables
from blink_appliance.kernels.skinny_gemm import skinny_gemm
from blink_appliance.model.config import ModelConfig
from blink_appliance.model.kv_cache import ForwardBatch, PagedKVCache
from blink_appliance.model.llama import rope_inv_freq


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


def attention_config(num_tokens: int) -> AttentionConfig:
    """Per bucket, from H100 sweeps (bench/attention_chain.py: 16 layers' launches in one graph, as the
    step runs them; docs/gpu_forward.md): decode buckets have few programs per layer, so key ranges are
    split to put more loads in flight and small programs (1-2 warps) start faster (T=32: 1 warp, 213 ->
    187 us for 16 layers); from 128 tokens on
    there are programs enough and the merge kernel would cost more than it saves; prefill-heavy buckets
    take 16-token query tiles and 64-key tiles.
    33-128 tokens: the attention does RoPE and the cache write itself (`fused_rope`; 1B T=128
    1.652-1.655 -> 1.638-1.640 ms, bench/results/2026-11-25-h100-forward-fused-rope.md). At 8 and
    32 tokens it measured slower (1-warp programs need more registers for it) or a tie, so those
    keep the RoPE kernel."""
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


def decode_gemms(num_tokens: int) -> DecodeGemms:
    """Per bucket, from bench/gemm_chain.py on the H100 (16 launches in one graph, as the step runs them;
    bench/results/2026-11-23-h100-gemm-chain*.json), then checked in the whole step (forward_levers.py,
    bench/results/2026-11-23-h100-forward-gated-gemm.md, 2026-11-23-h100-forward-accumulate.md).
    Prefill-sized buckets are compute-bound and take cuBLAS.

    O and down add their products into the fp32 residual stream (`accumulate`, split-K slices with
    atomics): no partials to write, and the norm after each reads only the stream (1B: T=8 1.199 ->
    1.153 ms, T=128 1.710 -> 1.673; O at 65-128 tokens moves off cuBLAS with it).
    Up to 16 tokens everything is Triton and the SiLU runs in the down GEMM's prologue: recomputed per
    weight tile, which is free at a few rows but costs 5x at 128; down splits 8 ways there.
    From 17 tokens on all rows sit in one 8-warp tile (weights read once), QKV splits K in two (RoPE sums
    the halves, kept in the weights' dtype: half the bytes of fp32) and QKV and O take 128-deep K tiles.
    17-64 tokens: SiLU in its own kernel (the gated gate+up GEMM measured slower here: 1.376 -> 1.393 ms
    at T=32). 65-128 tokens: the gate+up GEMM writes silu(gate)*up itself (no activation kernel, 1B
    T=128 1.806 -> 1.753 ms)."""
    if num_tokens <= 16:
        return DecodeGemms(
            qkv=GemmLaunch(split_k=4, block_k=64),
            o=GemmLaunch(split_k=4, accumulate=True),
            gate_up=GemmLaunch(block_n=128, block_k=64),
            down=GemmLaunch(split_k=8, accumulate=True),
            silu_in_down=True,
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


def deterministic_gemms(num_tokens: int) -> DecodeGemms:
    """`decode_gemms` without atomics: O and down write split-K partials that the next norm sums in a
    fixed order (fp32 up to 16 tokens, the weights' dtype above; O on cuBLAS at 65-128 tokens, where
    its partials cost more than cuBLAS), so the same step gives the same bits every run. 1B on the
    H100: T=8 1.127 -> 1.182 ms, T=128 1.652 -> 1.706 (bench/results/2026-11-23-h100-forward-accumulate.md)."""
    g = decode_gemms(num_tokens)
    if not g.accumulates:
        return g
    small = num_tokens <= 16
    o = replace(g.o, accumulate=False, fp32_partials=small) if num_tokens <= 64 else None
    return replace(g, o=o, down=replace(g.down, accumulate=False, fp32_partials=small))


def in_major(matrix: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix stored [in, out] contiguous (returned as the transposed view).

    Projection weights are kept this way: `x @ W.t()` is then a plain [in, out] operand, so cuBLAS
    runs its NN kernels (2-4% faster than TN for the 1B step at 8-128 tokens on the H100,
    bench/results/2026-11-23-h100-forward-levers.md), and the swap-AB GEMM reads it through strides.
    """
    return matrix.t().contiguous().t()


@dataclass
class LayerWeights:
    """One decoder layer, projections fused where one GEMM can do the work of several. Projection
    matrices are [out, in] views of [in, out] storage (`in_major`)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2*Hkv) * D, H]: q, k, v projections stacked
    qkv_bias: torch.Tensor | None  # Qwen2
    q_norm: torch.Tensor | None  # Qwen3, [D]
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2*I, H]: gate then up
    down: torch.Tensor  # [H, I]


@dataclass
class GpuWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same tensor as embed when tied

    @classmethod
    def from_hf(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> GpuWeights:
        """Fuse HF-named tensors (as Checkpoint.weights holds them) into the forward's layout."""

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([weights[n].to(dtype) for n in names]).to(device).contiguous()

        def mat(*names: str) -> torch.Tensor:
            return in_major(cat(*names))

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=mat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    qkv_bias=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                    if config.attention_bias
                    else None,
                    q_norm=w(a + "q_norm.weight") if config.qk_norm else None,
                    k_norm=w(a + "k_norm.weight") if config.qk_norm else None,
                    o_proj=mat(a + "o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=mat(p + "mlp.down_proj.weight"),
                )
            )
        embed = w("model.embed_tokens.weight")
        # A tied head stays the (row-major) embedding table: a transposed copy would cost its bytes again.
        lm_head = embed if config.tie_word_embeddings else mat("lm_head.weight")
        return cls(embed=embed, layers=layers, norm=w("model.norm.weight"), lm_head=lm_head)

    @classmethod
    def random(
        cls, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0
    ) -> GpuWeights:
        """Random weights drawn directly on `device` in `dtype` (no host copy; for large benchmarks)."""
        c = config
        gen = torch.Generator(device=device).manual_seed(seed)

        def mat(rows: int, cols: int) -> torch.Tensor:
            return in_major(torch.randn(rows, cols, generator=gen, device=device, dtype=dtype).mul_(0.02))

        def vec(n: int, mean: float = 1.0, std: float = 0.1) -> torch.Tensor:
            return torch.randn(n, generator=gen, device=device, dtype=dtype).mul_(std).add_(mean)

        qkv_rows = c.q_size + 2 * c.kv_size
        layers = [
            LayerWeights(
                input_norm=vec(c.hidden_size),
                qkv=mat(qkv_rows, c.hidden_size),
                qkv_bias=vec(qkv_rows, 0.0, 0.02) if c.attention_bias else None,
                q_norm=vec(c.head_dim) if c.qk_norm else None,
                k_norm=vec(c.head_dim) if c.qk_norm else None,
                o_proj=mat(c.hidden_size, c.q_size),
                post_norm=vec(c.hidden_size),
                gate_up=mat(2 * c.intermediate_size, c.hidden_size),
                down=mat(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        embed = mat(c.vocab_size, c.hidden_size).contiguous()  # gathered by rows
        lm_head = embed if c.tie_word_embeddings else mat(c.vocab_size, c.hidden_size)
        return cls(embed=embed, layers=layers, norm=vec(c.hidden_size), lm_head=lm_head)

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out

    def nbytes(self) -> int:
        """All weight bytes, the tied embedding counted once."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def bytes_read_per_step(self, num_tokens: int) -> int:
        """Weight bytes one step must read: everything but the embedding table, of which only
        `num_tokens` rows are gathered (unless it doubles as the LM head, which reads all of it)."""
        total = self.nbytes()
        if self.lm_head is self.embed:
            return total
        e = self.embed
        return total - e.numel() * e.element_size() + num_tokens * e.shape[1] * e.element_size()


@dataclass
class StepInputs:
    """The per-step metadata the scheduler writes (docs/kv_layout.md), at fixed capacity.

    Token-level tensors hold `max_tokens` rows; a bucket T reads the first T. Unused sequence slots
    have query_start[s+1] == query_start[s] and context_lens[s] == 0; unused sample rows hold -1.
    """

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64, -1 = padding
    query_start: torch.Tensor  # [max_seqs + 1] int32
    context_lens: torch.Tensor  # [max_seqs] int32
    block_tables: torch.Tensor  # [max_seqs, max_blocks_per_seq] int32
    sample_rows: torch.Tensor  # [max_seqs] int64, -1 = unused

    @classmethod
    def allocate(
        cls, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device | str
    ) -> StepInputs:
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        inputs = cls(
            input_ids=torch.zeros(max_tokens, **i64),
            positions=torch.zeros(max_tokens, **i64),
            slot_mapping=torch.zeros(max_tokens, **i64),
            query_start=torch.zeros(max_seqs + 1, **i32),
            context_lens=torch.zeros(max_seqs, **i32),
            block_tables=torch.zeros(max_seqs, max_blocks_per_seq, **i32),
            sample_rows=torch.zeros(max_seqs, **i64),
        )
        inputs.clear()
        return inputs

    def clear(self) -> None:
        """An empty step: no sequences, no writes, no samples (safe to run, e.g. to warm up)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.query_start.zero_()
        self.context_lens.zero_()
        self.block_tables.fill_(-1)
        self.sample_rows.fill_(-1)


class GpuForward:
    """Static-buffer forward runner; `step(T)` is what a CUDA graph captures per bucket."""

    def __init__(
        self,
        config: ModelConfig,
        weights: GpuWeights,
        kv: PagedKVCache,
        *,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        max_context_len: int | None = None,
        residual_fp32: bool = True,
        triton_gemm_max_tokens: int = 128,
        lm_head_fp32_out: bool | None = None,
        pdl: bool | None = None,
        triton_qkv: bool = True,
        gemm_plan: Callable[[int], DecodeGemms] = decode_gemms,
        attention_plan: Callable[[int], AttentionConfig] = attention_config,
    ) -> None:
        c = config
        self.config = c
        self.weights = weights
        self.kv = kv
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        if kv.k.dtype != self.dtype or kv.k.device != self.device:
            raise ValueError(
                f"KV cache is {kv.k.dtype} on {kv.k.device}; weights are {self.dtype} on {self.device}"
            )
        if kv.k.shape[0] != c.num_layers or kv.k.shape[3:] != (c.num_kv_heads, c.head_dim):
            raise ValueError(f"KV cache shape {tuple(kv.k.shape)} does not fit the model")
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_context_len = max_context_len or max_blocks_per_seq * kv.block_size
        if self.max_context_len > max_blocks_per_seq * kv.block_size:
            raise ValueError("max_context_len exceeds what max_blocks_per_seq blocks can hold")
        self.inputs = StepInputs.allocate(max_tokens, max_seqs, max_blocks_per_seq, self.device)
        self.cos, self.sin = rope_tables(rope_inv_freq(c), self.max_context_len, self.device)

        # Activations, sized for the largest bucket; a bucket uses leading rows. Shared by all buckets.
        def buf(*shape: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=self.device)

        T, H = max_tokens, c.hidden_size
        # The residual stream in fp32 under bf16 weights: the one place where keeping precision is
        # nearly free (a few KB per token). It puts the bf16 step nearer an fp32 reference than the
        # reference model's own bf16 run (1B: 2.4% vs 2.8%; smollm2, emulated on the CPU: 0.8% vs 1.4%).
        self._residual = buf(T, H, dtype=torch.float32 if residual_fp32 else self.dtype)
        self._normed = buf(T, H)
        self._qkv = buf(T, c.q_size + 2 * c.kv_size)
        self._attn = buf(T, c.q_size)
        self._proj = buf(T, H)  # output of o_proj and of down_proj: the next add's input
        self._gate_up = buf(T, 2 * c.intermediate_size)
        self._act = buf(T, c.intermediate_size)
        self._final = buf(max_seqs, H)
        # Buckets up to this many tokens take the Triton GEMMs of `gemm_plan` (0: cuBLAS throughout);
        # triton_qkv=False keeps QKV on cuBLAS even where the plan gives it a launch.
        self.triton_gemm_max_tokens = triton_gemm_max_tokens
        self.triton_qkv = triton_qkv
        # Per-bucket launch shapes; benchmarks pass their own to compare variants of the same step.
        self.gemm_plan = gemm_plan
        self.attention_plan = attention_plan
        # Programmatic dependent launch (Hopper+): every Triton kernel of the step launches while the
        # kernel before it drains, does what needs only the step's inputs and weights, then waits for
        # it (griddepcontrol.wait) before reading its outputs and before writing anything.
        # None: on where the GPU has it (compute capability >= 9).
        if pdl is None:
            pdl = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] >= 9
        self.pdl = pdl
        plans = [(t, self._gemms(t)) for t in range(1, T + 1)]
        if self._residual.dtype != torch.float32 and any(g.accumulates for _, g in plans):
            raise ValueError("a GEMM plan that accumulates into the residual stream needs residual_fp32")

        def partials(name: str, width: int, min_split: int) -> torch.Tensor | None:
            """fp32 split-K scratch for one projection, sized for the bucket that needs the most."""
            rows = max(
                (
                    launch.split_k * t
                    for t, g in plans
                    if (launch := getattr(g, name)) and launch.split_k >= min_split and not launch.accumulate
                ),
                default=0,
            )
            return buf(rows * width, dtype=torch.float32) if rows else None

        # RoPE reads QKV as partials whenever QKV is Triton; O and down write partials only when split
        # (and not accumulating into the residual).
        self._qkv_parts = partials("qkv", c.q_size + 2 * c.kv_size, 1)
        self._o_parts = partials("o", H, 2)
        self._down_parts = partials("down", H, 2)
        split_rows = max(
            (attention_plan(t).splits * t for t in range(1, T + 1) if attention_plan(t).splits > 1),
            default=0,
        )
        self._attn_partials = (
            split_partials(split_rows, 1, c.num_heads, c.head_dim, self.device) if split_rows else None
        )
        # bf16/fp16 LM head: cuBLAS writes fp32 logits itself (mm with out_dtype, CUDA only) instead of
        # a low-precision copy plus a cast kernel (-0.035 ms for the 1B step at 128 tokens).
        if lm_head_fp32_out is None:
            lm_head_fp32_out = self.device.type == "cuda"
        self.lm_head_fp32_out = lm_head_fp32_out and self.dtype != torch.float32
        lp = self.dtype != torch.float32 and not self.lm_head_fp32_out
        self._logits_lp = buf(max_seqs, c.vocab_size) if lp else None
        # fp32 logits of the sampled rows: what the sampler reads. Row r is for sample_rows[r].
        self.logits = buf(max_seqs, c.vocab_size, dtype=torch.float32)

    def _gemms(self, num_tokens: int) -> DecodeGemms:
        g = self.gemm_plan(num_tokens) if num_tokens <= self.triton_gemm_max_tokens else CUBLAS_GEMMS
        return g if self.triton_qkv else replace(g, qkv=None)

    def _split_out(self, scratch: torch.Tensor, launch: GemmLaunch, T: int, width: int) -> torch.Tensor:
        """A split GEMM's partials [split_k, T, width] in the fp32 scratch (viewed in the weights' dtype
        when the launch keeps them there)."""
        if not launch.fp32_partials:
            scratch = scratch.view(self.dtype)
        n = launch.split_k * T * width
        return scratch[:n].view(launch.split_k, T, width)

    def _residual_add(
        self, launch: GemmLaunch | None, scratch: torch.Tensor | None, h: torch.Tensor, proj: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For O or down (whose product the next norm adds to the stream h): where the GEMM writes, and
        what that norm adds. Accumulating, the GEMM adds into h itself and the norm adds nothing;
        split, its partials; else its one output in `proj`."""
        if launch is not None and launch.accumulate:
            return h, None
        T, H = h.shape
        out = self._split_out(scratch, launch, T, H) if launch is not None and launch.split_k > 1 else proj
        return out, out

    def num_sample_rows(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_seqs)

    def step(self, num_tokens: int) -> torch.Tensor:
        """One forward over the first `num_tokens` rows of the inputs; returns a view of the logits.

        Only device work on fixed buffers: safe to capture. Writes K/V of this step into the cache.
        """
        c, w, inp = self.config, self.weights, self.inputs
        T = num_tokens
        if T > self.max_tokens:
            raise ValueError(f"bucket {T} exceeds max_tokens {self.max_tokens}")
        R = self.num_sample_rows(T)
        eps = c.rms_norm_eps
        h, x, qkv, attn = self._residual[:T], self._normed[:T], self._qkv[:T], self._attn[:T]
        proj, gate_up, act = self._proj[:T], self._gate_up[:T], self._act[:T]
        positions, slots = inp.positions[:T], inp.slot_mapping[:T]
        ac = self.attention_plan(T)
        g = self._gemms(T)
        o_parts = g.o.split_k if g.o else 1
        down_parts = g.down.split_k if g.down else 1
        o_out, o_sum = self._residual_add(g.o, self._o_parts, h, proj)
        mlp_out, mlp_sum = self._residual_add(g.down, self._down_parts, h, proj)

        ids = inp.input_ids[:T]
        for i, layer in enumerate(w.layers):
            if i == 0:  # the stream starts as the token embeddings, gathered by the norm itself
                add_rmsnorm(w.embed, layer.input_norm, x, eps, residual=h, residual_in=False, x_rows=ids)
            else:
                add_rmsnorm(mlp_sum, layer.input_norm, x, eps, residual=h, x_parts=down_parts, pdl=self.pdl)
            qkv_parts = bias = None
            if g.qkv:  # split-K partials; RoPE sums them (and adds the bias)
                qkv_parts = self._split_out(self._qkv_parts, g.qkv, T, qkv.shape[1])
                skinny_gemm(x, layer.qkv, qkv_parts, **g.qkv.kernel_args(), pdl=self.pdl)
                bias = layer.qkv_bias
            elif layer.qkv_bias is not None:
                torch.addmm(layer.qkv_bias, x, layer.qkv.t(), out=qkv)
            else:
                torch.mm(x, layer.qkv.t(), out=qkv)
            k_cache, v_cache = self.kv.k[i], self.kv.v[i]
            if ac.fused_rope and layer.q_norm is None:
                rope = FusedRope(slots, self.cos, self.sin, qkv_parts, bias)
                q = qkv  # the whole QKV row (or its partials): the attention rotates q and k itself
            else:
                rope_and_cache_write(
                    qkv, positions, slots, self.cos, self.sin, k_cache, v_cache, c.num_heads, c.num_kv_heads,
                    c.head_dim, layer.q_norm, layer.k_norm, eps, pdl=self.pdl, qkv_parts=qkv_parts,
                    qkv_bias=bias,
                )  # fmt: skip
                rope, q = None, qkv[:, : c.q_size]
            paged_attention(
                q, k_cache, v_cache, attn, inp.query_start, inp.context_lens, inp.block_tables, c.num_heads,
                c.num_kv_heads, c.head_dim, c.head_dim**-0.5, block_q=ac.block_q, block_n=ac.block_n,
                num_splits=ac.splits, partials=self._attn_partials, num_warps=ac.num_warps,
                num_stages=ac.num_stages, pdl=self.pdl, rope=rope,
            )  # fmt: skip
            if g.o:
                skinny_gemm(attn, layer.o_proj, o_out, **g.o.kernel_args(), pdl=self.pdl)
            else:
                torch.mm(attn, layer.o_proj.t(), out=o_out)
            add_rmsnorm(o_sum, layer.post_norm, x, eps, residual=h, x_parts=o_parts, pdl=self.pdl)
            # The MLP: silu(gate)*up lands in `act` (from the gate+up GEMM's epilogue, or its own
            # kernel), unless the down GEMM computes it in its prologue from `gate_up`.
            if g.silu_in_gate_up:
                skinny_gemm(x, layer.gate_up, act, **g.gate_up.kernel_args(), gated=True, pdl=self.pdl)
            else:
                if g.gate_up:
                    skinny_gemm(x, layer.gate_up, gate_up, **g.gate_up.kernel_args(), pdl=self.pdl)
                else:
                    torch.mm(x, layer.gate_up.t(), out=gate_up)
                if not g.silu_in_down:
                    silu_and_mul(gate_up, act, pdl=self.pdl)
            if g.silu_in_down:
                skinny_gemm(
                    gate_up, layer.down, mlp_out, **g.down.kernel_args(), silu_gate=True, pdl=self.pdl
                )
            elif g.down:
                skinny_gemm(act, layer.down, mlp_out, **g.down.kernel_args(), pdl=self.pdl)
            else:
                torch.mm(act, layer.down.t(), out=mlp_out)

        final = self._final[:R]
        add_rmsnorm(
            mlp_sum,
            w.norm,
            final,
            eps,
            residual=h,
            write_residual=False,
            rows=inp.sample_rows[:R],
            x_parts=down_parts,
            pdl=self.pdl,
        )
        if self.lm_head_fp32_out:
            torch.mm(final, w.lm_head.t(), out_dtype=torch.float32, out=self.logits[:R])
        elif self._logits_lp is None:
            torch.mm(final, w.lm_head.t(), out=self.logits[:R])
        else:
            torch.mm(final, w.lm_head.t(), out=self._logits_lp[:R])
            self.logits[:R].copy_(self._logits_lp[:R])
        return self.logits[:R]

    def load_batch(self, batch: ForwardBatch, num_tokens: int) -> None:
        """Host-side helper (tests, benchmarks): copy a ForwardBatch into the static inputs for a bucket
        of `num_tokens`, padding the rest. The GPU loop's scheduler writes the inputs itself instead."""
        n, S = batch.num_tokens, batch.num_seqs
        if n > num_tokens or num_tokens > self.max_tokens:
            raise ValueError(f"{n} tokens do not fit bucket {num_tokens} (max_tokens {self.max_tokens})")
        if S > self.max_seqs or batch.sample_rows.shape[0] > self.num_sample_rows(num_tokens):
            raise ValueError(
                f"{S} sequences / {batch.sample_rows.shape[0]} samples exceed the bucket's capacity"
            )
        width = batch.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(
                f"block tables of width {width} exceed max_blocks_per_seq {self.max_blocks_per_seq}"
            )
        if n and int(batch.positions.max()) >= self.max_context_len:
            raise ValueError(f"a position exceeds max_context_len {self.max_context_len}")
        inp = self.inputs
        inp.clear()
        dev = self.device
        inp.input_ids[:n].copy_(batch.input_ids.to(dev))
        inp.positions[:n].copy_(batch.positions.to(dev))
        inp.slot_mapping[:n].copy_(batch.slot_mapping.to(dev))
        inp.query_start[: S + 1].copy_(batch.query_start.to(dev))
        inp.query_start[S + 1 :].fill_(int(batch.query_start[-1]))
        inp.context_lens[:S].copy_(batch.context_lens.to(dev))
        inp.block_tables[:S, :width].copy_(batch.block_tables.to(dev))
        inp.sample_rows[: batch.sample_rows.shape[0]].copy_(batch.sample_rows.to(dev))

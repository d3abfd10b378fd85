"""The fixed-shape forward pass: Triton kernels + cuBLAS GEMMs over static device buffers.

Everything a step reads lives in preallocated tensors (`StepInputs`), sized once for the largest
token bucket and `max_seqs`; a step over bucket T reads their first T rows. A step does no `.item()`,
no host sync and no allocation, so it can be captured in a CUDA graph (engine/loop/forward_graphs.py) and
replayed by the device-resident loop, which writes the inputs and reads `logits`.

Per layer: add+RMSNorm (Triton) -> fused QKV GEMM (+bias) -> RoPE + KV-cache write (Triton) ->
paged attention (Triton) -> O GEMM -> add+RMSNorm -> fused gate+up GEMM -> SiLU*up (Triton) -> down
GEMM. The first layer's norm gathers the token embeddings itself. GEMMs run through cuBLAS, except in
decode-sized buckets (<= 128 tokens by default), where all four run through the swap-AB Triton GEMM
(`decode_gemms`): QKV's split-K partials are summed by RoPE, and O and down add their products into
the fp32 residual stream themselves (atomics; `deterministic_gemms` writes partials instead, summed
by the next norm); SiLU*up moves into the gate+up GEMM's epilogue up to 16 tokens and at 65-128.
The final norm and the LM head run only on the `sample_rows` gather (a fixed number of rows per
bucket, min(T, max_seqs); unused entries are -1 and give zero logits). With `score_rows` > 0 the
final norm also gathers the `score_rows` inputs (prompt positions whose logprobs are scored) into
`score_final`; their LM head runs apart, in `score()`, only in the loop iterations that score.

It computes the same function as the reference model in llama.py (the tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from blink_appliance.kernels.activation import silu_and_mul
from blink_appliance.kernels.paged_attention import FusedRope, paged_attention
from blink_appliance.kernels.rmsnorm import PeerShare, add_rmsnorm
from blink_appliance.kernels.rope import rope_and_cache_write, rope_tables
from blink_appliance.kernels.skinny_gemm import skinny_gemm
from blink_appliance.kernels.split_kv import split_partials
from blink_appliance.model.config import ModelConfig
from blink_appliance.model.gpu_weights import GpuWeights
from blink_appliance.model.kv_cache import ForwardBatch, PagedKVCache
from blink_appliance.model.launch_plans import (
    CUBLAS_GEMMS,
    LM_HEAD_TRITON_ROWS,
    AttentionConfig,
    DecodeGemms,
    GemmLaunch,
    attention_config,
    decode_gemms,
)
from blink_appliance.model.llama import rope_inv_freq
from blink_appliance.model.step_inputs import StepInputs
from blink_appliance.model.tensor_parallel import RankLink


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
        gemm_plan: Callable[[int, ModelConfig], DecodeGemms] = decode_gemms,
        attention_plan: Callable[[int, ModelConfig], AttentionConfig] = attention_config,
        score_rows: int = 0,
        tp_rank: int | None = None,
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
        self.score_rows = score_rows
        self.inputs = StepInputs.allocate(max_tokens, max_seqs, max_blocks_per_seq, self.device, score_rows)
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
        # Tensor parallelism (model/tensor_parallel.py; `config` is then this rank's shard): down gets
        # its own output, since the peer may still read O's when this rank's down writes.
        self.tp = RankLink.allocate(tp_rank, c.num_layers, self.device) if tp_rank is not None else None
        self._proj_mlp = buf(T, H) if self.tp else self._proj
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
        if self.tp and any(g.accumulates for _, g in plans):
            raise ValueError("tensor parallelism needs a GEMM plan without atomics (deterministic_gemms)")

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
            (a.splits * t for t in range(1, T + 1) if (a := attention_plan(t, c)).splits > 1),
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
        # The scored prompt rows, normed by the step, and their logits once score() ran.
        self.score_final = buf(score_rows, H)
        self.score_logits = buf(score_rows, c.vocab_size, dtype=torch.float32)
        self._score_logits_lp = buf(score_rows, c.vocab_size) if lp else None

    def _gemms(self, num_tokens: int) -> DecodeGemms:
        g = (
            self.gemm_plan(num_tokens, self.config)
            if num_tokens <= self.triton_gemm_max_tokens
            else CUBLAS_GEMMS
        )
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

    def _shares(self, T: int, g: DecodeGemms) -> tuple[torch.Tensor, ...]:
        """Where O and down write this step and what the norms after them add: o_out, o_sum,
        mlp_out, mlp_sum."""
        h = self._residual[:T]
        o_out, o_sum = self._residual_add(g.o, self._o_parts, h, self._proj[:T])
        mlp_out, mlp_sum = self._residual_add(g.down, self._down_parts, h, self._proj_mlp[:T])
        return o_out, o_sum, mlp_out, mlp_sum

    def _peer(self, share: torch.Tensor | None, point: int) -> PeerShare | None:
        """The peer's share for the norm at flag `point` (None without tensor parallelism)."""
        if self.tp is None:
            return None
        if self.tp.peer is None and not self.tp.solo:
            raise RuntimeError("a tensor-parallel forward runs only once connected to its peer (connect)")
        peer_flags = self.tp.flags if self.tp.solo else self.tp.peer.tp.flags
        return PeerShare(self.tp.rank, share, self.tp.flags, peer_flags, self.tp.epoch, point)

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
        gate_up, act = self._gate_up[:T], self._act[:T]
        positions, slots = inp.positions[:T], inp.slot_mapping[:T]
        ac = self.attention_plan(T, c)
        g = self._gemms(T)
        o_parts = g.o.split_k if g.o else 1
        down_parts = g.down.split_k if g.down else 1
        o_out, o_sum, mlp_out, mlp_sum = self._shares(T, g)
        peer_o = peer_mlp = None
        if self.tp is not None:
            self.tp.epoch.add_(1)  # both ranks count steps alike; a flag holds the step it was set in
            if self.tp.solo:  # warming up alone (tensor_parallel.warm_alone): its own share stands in
                peer_o, peer_mlp = o_sum, mlp_sum
            elif self.tp.peer is not None:
                _, peer_o, _, peer_mlp = self.tp.peer._shares(T, g)

        ids = inp.input_ids[:T]
        for i, layer in enumerate(w.layers):
            if i == 0:  # the stream starts as the token embeddings, gathered by the norm itself
                add_rmsnorm(w.embed, layer.input_norm, x, eps, residual=h, residual_in=False, x_rows=ids)
            else:
                add_rmsnorm(
                    mlp_sum, layer.input_norm, x, eps, residual=h, x_parts=down_parts, pdl=self.pdl,
                    peer=self._peer(peer_mlp, 2 * i - 1),
                )  # fmt: skip
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
            add_rmsnorm(
                o_sum, layer.post_norm, x, eps, residual=h, x_parts=o_parts, pdl=self.pdl,
                peer=self._peer(peer_o, 2 * i),
            )  # fmt: skip
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
        P = min(T, self.score_rows)
        add_rmsnorm(
            mlp_sum, w.norm, final, eps, residual=h, write_residual=False, rows=inp.sample_rows[:R],
            x_parts=down_parts, pdl=self.pdl, rows2=inp.score_rows[:P] if P else None,
            out2=self.score_final if P else None, peer=self._peer(peer_mlp, 2 * len(w.layers) - 1),
        )  # fmt: skip
        if self.tp is not None and self.tp.rank != 0:
            return self.logits[:R]  # rank 0 alone computes the logits
        return self._lm_head(final, self.logits[:R], self._logits_lp)

    def score(self) -> torch.Tensor:
        """The LM head over the last step's scored prompt rows (score_final): fp32 logits
        [score_rows, V], row i for inputs.score_rows[i] (rows of unused entries are stale)."""
        return self._lm_head(self.score_final, self.score_logits, self._score_logits_lp)

    def _lm_head(self, final: torch.Tensor, out: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits of the normed rows `final` into `out` (through `low` where cuBLAS cannot
        write fp32 itself)."""
        lm_head = self.weights.lm_head
        fp32_out = self.lm_head_fp32_out or self.dtype == torch.float32
        if fp32_out and final.shape[0] <= LM_HEAD_TRITON_ROWS:
            # As fast as cuBLAS at these rows, and its weights go through L2 evict-first (skinny_gemm).
            skinny_gemm(final, lm_head, out, block_n=128, block_k=128, pdl=self.pdl)
        elif self.lm_head_fp32_out:
            torch.mm(final, lm_head.t(), out_dtype=torch.float32, out=out)
        elif low is None:
            torch.mm(final, lm_head.t(), out=out)
        else:
            rows = final.shape[0]
            torch.mm(final, lm_head.t(), out=low[:rows])
            out.copy_(low[:rows])
        return out

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

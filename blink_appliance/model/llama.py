"""The Llama-family decoder in plain PyTorch: the CPU reference model.

One file, top to bottom: RoPE tables, RMSNorm, attention over the paged KV cache, SwiGLU MLP, the
decoder layer, the model. It covers Llama 2/3.x (incl. "llama3" RoPE scaling), Mistral, Qwen2 (q/k/v
bias), Qwen3 (per-head q/k RMSNorm) and SmolLM2. Parameter names follow Hugging Face's
LlamaForCausalLM so checkpoints load without renaming.

A forward step takes a flat batch of tokens from many sequences (prefill chunks and decode tokens
mixed) described by a ForwardBatch, writes their K/V into the paged cache, and returns logits only for
the rows that sample. The GPU forward (kernels/) computes the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.kv_cache import ForwardBatch, PagedKVCache


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for the rotary embedding, with Llama 3's frequency scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, head_dim] for the rotate-half convention, computed in fp32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate-half RoPE (HF convention, not interleaved)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and cast back before the weight, as the reference implementations do.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass
class QueryGroup:
    """Sequences whose queries attend together in one padded SDPA call.

    Queries are laid out [S, max_q] and keys [S, max_ctx]; padding queries repeat the sequence's first
    row (their output is dropped), padding keys point at slot 0 and are masked off.
    """

    rows: torch.Tensor  # [S, max_q] int64: row of each query in the flat batch
    valid_entries: torch.Tensor  # [N] int64: which entries of the flattened [S * max_q] are real queries
    valid_rows: torch.Tensor  # [N] int64: their rows in the flat batch
    key_slots: torch.Tensor  # [S, max_ctx] int64: cache slot of each key position, 0 past the context
    mask: torch.Tensor  # [S, 1, max_q, max_ctx] additive (0 or -inf): causal, only keys inside the context


@dataclass
class AttentionPlan:
    """A step's gather/scatter indices, computed once per forward and shared by every layer.

    Decode tokens (one query per sequence) form one group; prefill chunks another, padded to the
    longest chunk. Keeping them apart stops one long prefill from padding every decode query.
    """

    write_rows: torch.Tensor | None  # [W] rows whose K/V are written; None: every row
    write_slots: torch.Tensor  # [W] their cache slots
    groups: list[QueryGroup]


def _query_group(batch: ForwardBatch, seqs: torch.Tensor, block_size: int, dtype: torch.dtype) -> QueryGroup:
    starts = batch.query_start[:-1].to(torch.int64)[seqs]
    n_q = batch.query_start[1:].to(torch.int64)[seqs] - starts
    n_ctx = batch.context_lens.to(torch.int64)[seqs]
    q_idx = torch.arange(int(n_q.max()), device=seqs.device)
    valid = q_idx[None, :] < n_q[:, None]
    rows = starts[:, None] + torch.where(valid, q_idx[None, :], 0)
    k_pos = torch.arange(int(n_ctx.max()), device=seqs.device)
    blocks = batch.block_tables[seqs][:, k_pos // block_size].to(torch.int64)
    key_slots = torch.where(k_pos[None, :] < n_ctx[:, None], blocks * block_size + k_pos % block_size, 0)
    # A query at position p sees keys 0..p; p < context_len, so keys past the context stay masked.
    visible = k_pos[None, None, :] <= batch.positions[rows][:, :, None]
    # Additive rather than boolean: SDPA would convert a boolean mask again in every layer.
    mask = torch.zeros(visible.shape, dtype=dtype, device=seqs.device).masked_fill_(~visible, -math.inf)
    valid_entries = valid.flatten().nonzero()[:, 0]
    return QueryGroup(rows, valid_entries, rows.flatten()[valid_entries], key_slots, mask[:, None])


def plan_attention(batch: ForwardBatch, block_size: int, dtype: torch.dtype) -> AttentionPlan:
    """dtype: the queries' (the mask is added to their scores)."""
    written = batch.slot_mapping >= 0
    if bool(written.all()):
        write_rows, write_slots = None, batch.slot_mapping
    else:
        write_rows = written.nonzero()[:, 0]
        write_slots = batch.slot_mapping[write_rows]
    n_q = batch.query_start[1:] - batch.query_start[:-1]
    groups = []
    for seqs in ((n_q == 1).nonzero()[:, 0], (n_q > 1).nonzero()[:, 0]):  # empty sequences attend nowhere
        if seqs.numel():
            groups.append(_query_group(batch, seqs, block_size, dtype))
    return AttentionPlan(write_rows, write_slots, groups)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for an integer index of any shape, through index_select (aten::index is slower on the CPU)."""
    return x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:])


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Causal attention of each query token over its sequence's keys in the paged cache.

    q: [T, n_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, n_kv, head_dim] (one layer).
    Returns [T, n_heads, head_dim]; padding rows (past the last sequence's run) are zero.
    """
    out = torch.zeros_like(q)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    for g in plan.groups:
        keys = gather_rows(flat_k, g.key_slots).transpose(1, 2)  # [S, n_kv, max_ctx, D]
        values = gather_rows(flat_v, g.key_slots).transpose(1, 2)
        queries = gather_rows(q, g.rows).transpose(1, 2)  # [S, n_heads, max_q, D]
        attn = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=True
        )  # [S, n_heads, max_q, D]
        attn = attn.transpose(1, 2).reshape(-1, *q.shape[1:])
        out.index_copy_(0, g.valid_rows, attn.index_select(0, g.valid_entries))
    return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        q = self.q_proj(x).view(T, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # Write this step's K/V first so that a token attends to itself and earlier tokens of its chunk.
        if plan.write_rows is not None:
            k, v = k.index_select(0, plan.write_rows), v.index_select(0, plan.write_rows)
        k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, plan.write_slots, k)
        v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, plan.write_slots, v)

        attn = paged_attention(q, k_cache, v_cache, plan, scale=c.head_dim**-0.5)
        return self.o_proj(attn.reshape(T, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, plan, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the parameters under `model.` so names match HF checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Uninitialized: build_model loads every weight, and the default init on the meta device would
        # import torch._dynamo (1.5 s of every engine start, 4 s without .pyc files).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Set by build_model once on its device (on the meta device the arithmetic imports torch._dynamo).
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        # A module computing the logits when the output matrix is kept quantized (loaders/quantize.py);
        # None: F.linear with the output embedding, the reference's exact fp path.
        self.output_head: nn.Module | None = None

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in; every parameter must be present and no name left over."""
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(weights))
        unexpected = sorted(set(weights) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the {self.config.arch} model: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        with torch.no_grad():
            for name, p in params.items():
                w = weights[name]
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(w.shape)} != model shape {tuple(p.shape)}"
                    )
                p.copy_(w)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, x.dtype)
        plan = plan_attention(batch, kv.block_size, x.dtype)  # once per step, not once per layer
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, plan, kv.k[i], kv.v[i])
        h = self.model.norm(x[batch.sample_rows])
        if self.output_head is not None:
            return self.output_head(h).float()
        return F.linear(h, self.output_embedding).float()

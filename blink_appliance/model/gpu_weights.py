"""The forward's weights on the device: HF-named checkpoint tensors fused into one GEMM per group
(q/k/v, gate/up) and stored input-major, the layout model/gpu_forward.py reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blink_appliance.model.config import ModelConfig


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

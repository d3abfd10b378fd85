"""RMSNorm(+residual), RoPE + KV-cache write, SiLU-and-mul vs plain-torch references.

Without a GPU the kernels run under Triton's interpreter (set before the kernels import).
Outputs are poisoned with NaN first; every row the kernel owns must be written.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.activation import silu_and_mul  # noqa: E402
from blink_appliance.kernels.rmsnorm import add_rmsnorm  # noqa: E402
from blink_appliance.kernels.rope import rope_and_cache_write, rope_tables  # noqa: E402

from blink_appliance.model.config import ModelConfig, RopeScaling  # noqa: E402
from blink_appliance.model.llama import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if GPU else [torch.float32]
HIDDEN = [2048, 4096, 576] if GPU else [64, 40]


def tol(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return norm(x)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_with_residual(hidden, dtype):
    T = 13
    x = torch.randn(T, hidden, dtype=dtype, device=DEVICE)
    res = torch.randn(T, hidden, dtype=dtype, device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    summed = x + res
    want = ref_rmsnorm(summed, w, 1e-5)
    out = torch.full_like(x, float("nan"))
    res_k = res.clone()
    add_rmsnorm(x, w, out, 1e-5, residual=res_k)
    assert torch.isfinite(out).all()
    assert torch.equal(res_k, summed), "the residual stream must hold x + residual"
    assert rel(out, want) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_residual_stream_start_and_fp32_stream(dtype):
    """residual_in=False starts the stream (residual = x); an fp32 stream under bf16 activations adds
    without rounding to bf16."""
    hidden = HIDDEN[0]
    x = torch.randn(5, hidden, dtype=dtype, device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    stream = torch.full((5, hidden), float("nan"), dtype=torch.float32, device=DEVICE)
    out = torch.full_like(x, float("nan"))
    add_rmsnorm(x, w, out, 1e-5, residual=stream, residual_in=False)
    assert torch.equal(stream, x.float())
    assert rel(out, ref_rmsnorm(x, w, 1e-5)) < tol(dtype)

    y = torch.randn_like(x)
    before = stream.clone()
    add_rmsnorm(y, w, out, 1e-5, residual=stream)
    want_stream = before + y.float()
    assert rel(stream, want_stream) < 1e-6
    want = (
        w.float()
        * (want_stream * torch.rsqrt(want_stream.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    )
    assert rel(out, want) < tol(dtype)
    with pytest.raises(ValueError, match="residual_in=False"):
        add_rmsnorm(x, w, out, 1e-5, residual_in=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_gathers_x_rows_from_an_embedding_table(dtype):
    """x_rows: the first layer's norm reads its rows out of the embedding table by token id (repeats
    included) and starts the stream with them; refused together with rows or partials."""
    hidden = HIDDEN[0]
    table = torch.randn(11, hidden, dtype=dtype, device=DEVICE)
    ids = torch.tensor([3, 0, 10, 3, 7], device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    stream = torch.full((5, hidden), float("nan"), dtype=torch.float32, device=DEVICE)
    out = torch.full((5, hidden), float("nan"), dtype=dtype, device=DEVICE)
    add_rmsnorm(table, w, out, 1e-5, residual=stream, residual_in=False, x_rows=ids)
    assert torch.equal(stream, table[ids].float())
    assert rel(out, ref_rmsnorm(table[ids], w, 1e-5)) < tol(dtype)
    with pytest.raises(ValueError, match="x_rows gathers plain x rows"):
        add_rmsnorm(table, w, out, 1e-5, residual=stream, x_rows=ids, rows=ids)


def test_rmsnorm_sums_split_k_partials():
    """x given as fp32 partials [P, N, H] (a split-K GEMM's output): summed, then add + norm."""
    hidden, parts, n = HIDDEN[0], 3, 6
    dtype = torch.bfloat16 if GPU else torch.float32
    partials = torch.randn(parts, n, hidden, device=DEVICE)
    res = torch.randn(n, hidden, device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    summed = res + partials.sum(0)
    out = torch.full((n, hidden), float("nan"), dtype=dtype, device=DEVICE)
    add_rmsnorm(partials, w, out, 1e-5, residual=res, x_parts=parts)
    assert rel(res, summed) < 1e-6
    want = w.float() * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    assert rel(out, want) < tol(dtype)
    # the final-norm form: gathered rows, stream not written back
    rows = torch.tensor([5, -1, 0], device=DEVICE)
    out3 = torch.full((3, hidden), float("nan"), dtype=dtype, device=DEVICE)
    before = res.clone()
    add_rmsnorm(partials, w, out3, 1e-5, residual=res, write_residual=False, rows=rows, x_parts=parts)
    assert torch.equal(res, before) and (out3[1] == 0).all()
    s2 = before[[5, 0]] + partials[:, [5, 0]].sum(0)
    want2 = w.float() * (s2 * torch.rsqrt(s2.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    assert rel(out3[[0, 2]], want2) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_plain_and_gathered_rows(dtype):
    hidden = HIDDEN[0]
    x = torch.randn(9, hidden, dtype=dtype, device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out = torch.full_like(x, float("nan"))
    add_rmsnorm(x, w, out, 1e-6)
    assert rel(out, ref_rmsnorm(x, w, 1e-6)) < tol(dtype)

    # Final norm: only the sampled rows, residual read but not written back; -1 gives a zero row.
    res = torch.randn_like(x)
    res_before = res.clone()
    rows = torch.tensor([8, 0, 3, -1], device=DEVICE)
    out = torch.full((4, hidden), float("nan"), dtype=dtype, device=DEVICE)
    add_rmsnorm(x, w, out, 1e-6, residual=res, write_residual=False, rows=rows)
    want = ref_rmsnorm((x + res)[rows[:3]], w, 1e-6)
    assert torch.equal(res, res_before)
    assert rel(out[:3], want) < tol(dtype)
    assert (out[3] == 0).all()


def test_rmsnorm_gathers_a_second_row_list_into_its_own_output():
    """The final norm's scored prompt rows (rows2 -> out2) in the launch of the sample rows, from
    split-K partials: equal to a launch of their own; unused (-1) entries leave out2 as it was."""
    hidden, parts, n = HIDDEN[0], 2, 7
    dtype = torch.bfloat16 if GPU else torch.float32
    partials = torch.randn(parts, n, hidden, device=DEVICE)
    res = torch.randn(n, hidden, device=DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    rows, rows2 = torch.tensor([6, -1], device=DEVICE), torch.tensor([2, 3, 4, -1, -1], device=DEVICE)
    out = torch.full((2, hidden), float("nan"), dtype=dtype, device=DEVICE)
    out2 = torch.full((5, hidden), float("nan"), dtype=dtype, device=DEVICE)
    add_rmsnorm(partials, w, out, 1e-5, residual=res, write_residual=False, rows=rows, x_parts=parts,
                rows2=rows2, out2=out2)  # fmt: skip
    alone, alone2 = torch.empty_like(out), torch.empty_like(out2)
    add_rmsnorm(partials, w, alone, 1e-5, residual=res, write_residual=False, rows=rows, x_parts=parts)
    add_rmsnorm(partials, w, alone2, 1e-5, residual=res, write_residual=False, rows=rows2, x_parts=parts)
    assert torch.equal(out, alone) and torch.equal(out2[:3], alone2[:3])
    assert out2[3:].isnan().all(), "unused entries are not written"
    with pytest.raises(ValueError, match="rows2 and out2 come together"):
        add_rmsnorm(partials, w, out, 1e-5, residual=res, rows=rows, x_parts=parts, rows2=rows2, out2=out2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    inter = 8192 if GPU else 96
    gate_up = torch.randn(7, 2 * inter, dtype=dtype, device=DEVICE)
    out = torch.full((7, inter), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul(gate_up, out)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert torch.isfinite(out).all()
    assert rel(out, want) < tol(dtype)


def _rope_config(head_dim: int, scaled: bool, qk_norm: bool, heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(
        arch="qwen3" if qk_norm else "llama",
        vocab_size=32,
        hidden_size=heads * head_dim,
        intermediate_size=32,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=500000.0,
        qk_norm=qk_norm,
        max_position_embeddings=131072,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192) if scaled else None,
    )


ROPE_CASES = (
    [(32, 8, 64, True, False), (32, 8, 128, True, False), (16, 8, 128, False, True), (9, 3, 64, False, False)]
    if GPU
    else [(4, 2, 16, True, False), (6, 2, 32, False, True), (3, 3, 16, False, False)]
)


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["qkv", "parts"])
def test_rope_and_cache_write(case, dtype, source):
    """source "parts": the row arrives as 3 fp32 split-K partials plus a bias (the Triton QKV GEMM)."""
    H, HKV, D, scaled, qk_norm = case
    cfg = _rope_config(D, scaled, qk_norm, H, HKV)
    T, num_blocks, bs, max_pos = 11, 7, 4, 20000
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=gen).to(dtype)
    if source == "parts":
        parts = torch.randn(3, *qkv.shape, generator=gen)
        bias = torch.randn(qkv.shape[1], generator=gen).to(dtype)
        qkv = (parts[0] + parts[1] + parts[2] + bias.float()).to(dtype)  # the kernel's order of sums
    # Positions far out exercise Llama-3's scaled low frequencies; slot -1 rows are padding.
    positions = torch.randint(0, max_pos, (T,), generator=gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T]
    slots[[2, 9]] = -1
    k_cache = torch.full((num_blocks, bs, HKV, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    q_norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype) if qk_norm else None
    k_norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype) if qk_norm else None

    # Reference: the model's own functions.
    inv = rope_inv_freq(cfg)
    q = qkv[:, : H * D].view(T, H, D).float()
    k = qkv[:, H * D : (H + HKV) * D].view(T, HKV, D).float()
    v = qkv[:, (H + HKV) * D :].view(T, HKV, D)
    if qk_norm:
        q, k = ref_rmsnorm(q, q_norm.float(), 1e-6), ref_rmsnorm(k, k_norm.float(), 1e-6)
    cos, sin = rope_cos_sin(inv, positions, torch.float32)
    q_want, k_want = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    cos_t, sin_t = rope_tables(inv, max_pos, DEVICE)
    # A copy even on the CPU (.to would alias there), so the checks below compare against the input.
    qkv_d, kc, vc = qkv.clone().to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE)
    extra = {}
    if source == "parts":
        qkv_d.fill_(float("nan"))  # only the partials carry the row; q is written here
        extra = dict(qkv_parts=parts.to(DEVICE), qkv_bias=bias.to(DEVICE))
    rope_and_cache_write(
        qkv_d,
        positions.to(DEVICE),
        slots.to(DEVICE),
        cos_t,
        sin_t,
        kc,
        vc,
        H,
        HKV,
        D,
        q_norm=None if q_norm is None else q_norm.to(DEVICE),
        k_norm=None if k_norm is None else k_norm.to(DEVICE),
        eps=1e-6,
        **extra,
    )
    got_q = qkv_d[:, : H * D].view(T, H, D).cpu()
    assert rel(got_q, q_want) < tol(dtype)
    write = slots >= 0
    flat_k, flat_v = kc.cpu().view(-1, HKV, D), vc.cpu().view(-1, HKV, D)
    assert rel(flat_k[slots[write]], k_want[write]) < tol(dtype)
    assert torch.equal(flat_v[slots[write]], v[write])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[write]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all(), "wrote a -1 slot"
    # k and v in the qkv buffer are left as they were (only q is rotated in place).
    if source == "qkv":
        assert torch.equal(qkv_d[:, H * D :].cpu(), qkv[:, H * D :])
    else:
        assert torch.isnan(qkv_d[:, H * D :]).all()


def test_rope_and_cache_write_refuses_mismatched_partials():
    H, HKV, D, T = 4, 2, 16, 3
    qkv = torch.zeros(T, (H + 2 * HKV) * D)
    cache = torch.zeros(2, 4, HKV, D)
    cos = sin = torch.zeros(8, D // 2)
    args = (qkv, torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), cos, sin, cache, cache)
    with pytest.raises(ValueError, match="must be fp32"):
        rope_and_cache_write(*args, H, HKV, D, qkv_parts=torch.zeros(2, T + 1, qkv.shape[1]))
    with pytest.raises(ValueError, match="qkv_bias goes with qkv_parts"):
        rope_and_cache_write(*args, H, HKV, D, qkv_bias=torch.zeros(qkv.shape[1]))

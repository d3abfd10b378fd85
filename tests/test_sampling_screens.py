"""The cheap screens inside the device sampler's kernels (kernels/sampling.py, sampling_rejection.py):
the race's screened score picks the exact winner, and the top-p mass and top-k count rank by x / t
exactly rounded.

Without a GPU the kernels run under the Triton interpreter; the screen's error bound is measured on
the GPU only (it is a property of the GPU's fast log).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from blink_appliance.kernels.sampling import SCREEN_WINDOW, _screen_gumbel  # noqa: E402
from blink_appliance.kernels.sampling_rejection import _mass_chunk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _mass_kernel(
    logits_ptr, t_ptr, top_p_ptr, top_k_ptr, candidate_ptr, lse_ptr, out_ptr, count_ptr, V, CHUNK: tl.constexpr,
    PRECISE: tl.constexpr,
):  # fmt: skip
    # A top-p row (top_k 0) in the top-k kernel (TOP_K, so it counts too): the row's max, the select,
    # the bins and the top-k set's mass are not read or written, so t_ptr and count_ptr stand in.
    _mass_chunk(
        0, 0, logits_ptr, V, t_ptr, top_p_ptr, top_k_ptr, candidate_ptr, t_ptr, lse_ptr, count_ptr, out_ptr,
        count_ptr, count_ptr, out_ptr, V, 1, CHUNK, PRECISE, True, False,
    )  # fmt: skip


def test_top_p_mass_ranks_by_rounded_x_over_t():
    """3.3 and the next float above it tie once divided by 0.7, so the token holding the larger one
    ranks after the candidate (its index is higher), not before it as the logits alone would say."""
    t = 0.7
    above = float(torch.nextafter(torch.tensor(3.3), torch.tensor(10.0)))
    logits = torch.zeros(64)
    logits[5], logits[9], logits[20] = 3.3, above, 4.0
    assert (logits[5] / t).item() == (logits[9] / t).item() and logits[9] > logits[5]
    x = logits / t
    lse = torch.logsumexp(x, 0)
    out = torch.zeros(1, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    _mass_kernel[(1,)](
        logits.to(DEVICE), torch.tensor([t], device=DEVICE), torch.tensor([0.9], device=DEVICE),
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        torch.tensor([5], device=DEVICE), lse.reshape(1).to(DEVICE), out, count, 64, CHUNK=64,
        PRECISE=DEVICE == "cuda",
    )  # fmt: skip
    want = torch.exp(x[20] - lse)  # only the 4.0 ranks before the candidate
    assert torch.allclose(out.cpu(), want.reshape(1), rtol=1e-5), (out, want, torch.exp(x[9] - lse))
    assert count.item() == 1  # top-k's count of tokens above it ranks the same way: the tie is not above


@triton.jit
def _screen_error_kernel(out_ptr, N, BLOCK: tl.constexpr):
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = (m.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    exact = -tl.extra.cuda.libdevice.log(-tl.extra.cuda.libdevice.log(u))
    err = tl.abs(_screen_gumbel(m, True) - exact)
    tl.atomic_max(out_ptr, tl.max(tl.where(m < N, err, 0.0), 0))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the bound is the GPU's fast log's; needs a CUDA GPU"
)
def test_screen_error_is_far_inside_the_window():
    """Over every one of the 2^23 uniforms, the cheap -log(-log(u)) is within 5e-5 of the exact one:
    40x inside the narrowest window (SCREEN_WINDOW * 32)."""
    out = torch.zeros(1, device="cuda")
    n = 1 << 23
    _screen_error_kernel[(n // 1024,)](out, n, BLOCK=1024)
    assert out.item() < 5e-5 <= SCREEN_WINDOW.value * 32 / 39, out.item()

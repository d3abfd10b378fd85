"""The interpreter skip (tests/interpreter_speed.py) keeps kernels' results and the language's restore."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip(
        "the skip is for Triton's CPU interpreter; this machine compiles kernels", allow_module_level=True
    )
os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tests.interpreter_speed import apply  # noqa: E402


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus_one(x):
    return _twice(x) // 2 + 1  # a helper calling a helper: both take the skip


@triton.jit
def _kernel(src, dst, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst + offs, _plus_one(tl.load(src + offs)))


def test_helpers_run_patched_and_the_launch_still_restores_the_language():
    import triton.runtime.interpreter as interp

    assert apply(), "the interpreter is imported and on, so the skip must be in place"
    assert interp._patch_lang.skips_patched
    src = torch.arange(16, dtype=torch.int32)
    dst = torch.zeros_like(src)
    _kernel[(1,)](src, dst, N=16)
    assert torch.equal(dst, src + 1)
    assert tl.core.is_builtin(tl.load), "the launch's patches must be undone after it"
    dst.zero_()
    _kernel[(1,)](src * 3, dst, N=16)
    assert torch.equal(dst, src * 3 + 1)

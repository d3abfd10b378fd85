"""The PTX a loop kernel compiles to for the H100 (sm_90), on a machine without a GPU: what the tests
of the kernels' memory-ordering instructions count. Use it in a process without TRITON_INTERPRET."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
from triton.backends.compiler import GPUTarget

_POINTER_TYPES = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.uint8: "*u8"}


def ptx_for_sm90(
    kernel: triton.JITFunction,
    args: Mapping[str, object],
    constexprs: Mapping[str, object],
    *,
    num_warps: int,
    scalar: str = "i64",
) -> str:
    """`kernel` compiled with a launcher's arguments by name (tensors as pointers, other arguments as
    `scalar`) and its compile-time values, with the GPU path (ON_GPU) on where the kernel has one."""
    if "ON_GPU" in kernel.arg_names:
        constexprs = dict(constexprs, ON_GPU=True)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            value = args[name]
            signature[name] = _POINTER_TYPES[value.dtype] if isinstance(value, torch.Tensor) else scalar
    compiled = triton.compile(
        triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    return compiled.asm["ptx"]

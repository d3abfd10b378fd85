"""Registers, spills and shared memory of the paged-attention kernel for the H100 (sm_90a), compiled
on this machine: no GPU needed, only Triton's bundled ptxas.

    python bench/kernel_registers.py

Occupancy explains much of the attention's speed: at T=128 a layer has ~1300 programs of 2 warps,
which fit the 132 SMs in one wave only at <= ~96 registers a thread (80 for the plain kernel). The
fused-RoPE tries of 2026-11-25 that ran slower used 128-255 (bench/results/2026-11-25-h100-forward-fused-rope.md).
Launch shapes are `attention_config`'s per bucket, Llama-3.2-1B's heads (32 q, 8 KV, head_dim 64).
The numbers are this machine's Triton's code; the GPU host's Triton version compiles its own, so
they are indicative (they did track the measured slowdowns on 2026-11-25).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blink_appliance.kernels import paged_attention as pa  # noqa: E402

from blink_appliance.model.launch_plans import attention_config  # noqa: E402

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
ARG_TYPES = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
    "partial_acc_ptr": "*fp32", "partial_ml_ptr": "*fp32", "query_start_ptr": "*i32",
    "context_lens_ptr": "*i32", "block_tables_ptr": "*i32", "num_tokens": "i32", "num_seqs": "i32",
    "q_stride": "i32", "out_stride": "i32", "block_table_stride": "i32", "qk_scale_log2": "fp32",
    "parts_ptr": "*bf16", "bias_ptr": "*fp32", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
    "part_stride": "i32", "max_positions": "i32",
}  # fmt: skip
STRIDES = ("q_stride", "out_stride", "part_stride", "block_table_stride")


def ptxas() -> Path:
    """The bundled ptxas: Triton 3.9 writes PTX that only its newer (Blackwell-era) ptxas reads."""
    newer = BIN / "ptxas-blackwell"
    return newer if newer.exists() else BIN / "ptxas"


def compile_attention(num_warps: int, num_stages: int, **constexprs) -> dict:
    fn = pa._paged_attention_kernel
    names = fn.arg_names
    const = dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, GROUP=4, GROUP_PAD=4, HEAD_DIM=64, SEQS_PAD=256,
                 DOT_PRECISION="tf32", USE_PDL=True, **constexprs)  # fmt: skip
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in ARG_TYPES:
            sig[n] = ARG_TYPES[n]
            if ARG_TYPES[n].startswith("*") or n in STRIDES:  # what the JIT specializes
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "constexpr"
            const.setdefault(n, fn.params[i].default)
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()}, attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(kernel.asm["ptx"])
        err = subprocess.run(
            [ptxas(), "-v", "-arch=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return dict(
        registers=int(regs.group(1)) if regs else None,
        spill_bytes=int(spill.group(1)) if spill else None,
        shared_bytes=kernel.metadata.shared,
    )


def main() -> None:
    print("| T | launch | fused RoPE | registers | spill stores (B) | shared (B) |")
    print("|---|---|---|---|---|---|")
    for T in (1, 4, 8, 32, 128, 512):
        a = attention_config(T)
        for fused in (False, True):
            parts = {8: 4, 32: 2, 128: 2}.get(T, 0) if fused else 0  # QKV's split-K partials per bucket
            r = compile_attention(
                a.num_warps, a.num_stages, BLOCK_Q=a.block_q, BLOCK_N=a.block_n, NUM_SPLITS=a.splits,
                FUSED_ROPE=fused, PARTS=parts,
            )  # fmt: skip
            shape = f"{a.block_q}q/{a.block_n}k/{a.splits}s/{a.num_warps}w/{a.num_stages}st"
            print(
                f"| {T} | {shape} | {fused} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} |"
            )


if __name__ == "__main__":
    main()

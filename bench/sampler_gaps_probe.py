"""Does a second kernel's shared memory, registers or carveout open a gap after a persistent one?

A probe, not product code. At one peaked row of top-k alone, compiling the chunk-bound gather into the
rejection variant added 6.3 µs to its graph replay, but only 2 µs to its two kernels' own times
(H200, bench/results/2026-11-29-h200-sampler-top-k-gather-presence.md); the gather code gives the
finisher 2 KB of static shared memory. This replays two stand-in kernels shaped like the variant's
pair (a persistent 4-warp queue kernel of 8 programs an SM, then one 8-warp program per row, all but
one leaving at once) and changes one property of the second at a time: its shared memory, its
registers, and the preferred shared-memory carveout of both.
Usage (GPU): python3 bench/sampler_gaps_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
import triton
import triton.language as tl

from bench.graph_timing import replay_us

CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


@triton.jit
def _queue_like(x_ptr, out_ptr, n, SORT: tl.constexpr):
    """Persistent programs: a little work each, a cross-warp reduction (shared memory)."""
    offs = tl.arange(0, 512)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if SORT > 0:
        s = tl.sort(tl.load(x_ptr + tl.arange(0, SORT)))
        v += tl.sum(s, 0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v, 0))


@triton.jit
def _finish_like(status_ptr, x_ptr, out_ptr, SORT: tl.constexpr, WIDE: tl.constexpr):
    """One program per row; rows with status 0 leave. SORT > 0 compiles a sort of SORT int64 (static
    shared memory) on a path no row takes; WIDE a register-heavy one."""
    r = tl.program_id(0)
    status = tl.load(status_ptr + r)
    if status == 7:  # never
        if SORT > 0:
            s = tl.sort(tl.load(x_ptr + tl.arange(0, SORT)).to(tl.int64))
            tl.store(out_ptr + r, tl.sum(s, 0).to(tl.float32))
        if WIDE:
            a = tl.load(x_ptr + tl.arange(0, 4096))
            b = tl.load(x_ptr + 4096 + tl.arange(0, 4096))
            tl.store(out_ptr + r, tl.sum(a * b + tl.exp(a) * tl.log(b + 2.0), 0))
    elif status != 0:
        tl.store(out_ptr + r, tl.sum(tl.load(x_ptr + tl.arange(0, 2048)), 0))


def set_carveout(kernel, percent: int) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuFuncSetAttribute(
        ctypes.c_void_p(kernel.function),
        CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        ctypes.c_int(percent),
    )
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute: {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.rand(8192, device="cuda")
    out = torch.zeros(max(8 * sms, 256), device="cuda")
    status = torch.zeros(256, dtype=torch.int32, device="cuda")
    status[0] = 1
    rows = []

    def case(name, sort_q, sort_f, wide, carveout=None):
        kq = _queue_like[(8 * sms,)](x, out, 512, SORT=sort_q, num_warps=4)
        kf = _finish_like[(256,)](status, x, out, SORT=sort_f, WIDE=wide, num_warps=8)
        if carveout is not None:
            set_carveout(kq, carveout)
            set_carveout(kf, carveout)

        def pair():
            _queue_like[(8 * sms,)](x, out, 512, SORT=sort_q, num_warps=4)
            _finish_like[(256,)](status, x, out, SORT=sort_f, WIDE=wide, num_warps=8)

        def alone_q():
            _queue_like[(8 * sms,)](x, out, 512, SORT=sort_q, num_warps=4)

        def alone_f():
            _finish_like[(256,)](status, x, out, SORT=sort_f, WIDE=wide, num_warps=8)

        r = dict(case=name, shared_q=kq.metadata.shared, shared_f=kf.metadata.shared, regs_f=kf.n_regs,
                 pair_us=replay_us(pair), queue_us=replay_us(alone_q), finish_us=replay_us(alone_f))  # fmt: skip
        rows.append(r)
        print(f"| {name} | {r['shared_q']} / {r['shared_f']} B | {r['regs_f']} | {r['pair_us']:.2f} | "
              f"{r['queue_us']:.2f} | {r['finish_us']:.2f} |", flush=True)  # fmt: skip

    print(
        f"{torch.cuda.get_device_name()}\n| case | shared q / f | regs f | pair µs | queue µs | finish µs |"
    )
    case("plain", 0, 0, False)
    case("finisher sorts 256 (2 KB)", 0, 256, False)
    case("finisher wide", 0, 0, True)
    case("finisher sorts and is wide", 0, 256, True)
    case("queue sorts 512 too", 512, 256, False)
    case("plain, carveout 100 both", 0, 0, False, 100)
    case("finisher sorts, carveout 100 both", 0, 256, False, 100)
    case("finisher sorts, carveout 0 both", 0, 256, False, 0)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

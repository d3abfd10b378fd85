"""Is a grid barrier inside one persistent kernel cheaper than a kernel boundary with PDL? The
question a decode megakernel stands on, asked of the batch-1 projections that run furthest below the
copy rate (QKV at 2.8 TB/s, O at 2.4 on the H200: bench/results/2026-11-28-h200-step-timeline.md).

    PYTHONPATH=. python3 bench/persistent_chain.py [--layers 16] [--out FILE]

Both sides run 16 layers of one-row QKV (2048 -> 3072) then O (2048 -> 2048), bf16 weights stored
[in, out] as the forward stores them, timed as CUDA graph replays:

- `chain`: the forward's own kernels, `skinny_gemm` with its batch-1 plan (QKV split 4 in 64-deep K
  tiles into fp32 partials, O split 4 adding into an fp32 stream), each a programmatic dependent
  launch: 32 kernels.
- `persistent`: one kernel of one program per SM. Each phase cuts its weight tiles into equal runs
  of K tiles, one run a program (stream-K: no partial second wave), adds the run's product into the
  phase's fp32 output with atomics, then meets every other program at a grid barrier (an atomic
  counter, released and acquired at GPU scope) before the next phase reads that output.
- `resident`: the persistent kernel with each program's next-phase weights loaded into registers (a
  block of 8 units and one of 4, units of 64 x 64) before the barrier that ends the phase before.
- `barriers`: the persistent kernel with no weights: what 32 barriers cost alone.

The persistent kernel's output is checked against torch (fp32, the input rounded to bf16 each phase
as the kernel rounds it) before it is timed. It needs every program resident at once, so it is a
GPU-only experiment: the CPU interpreter runs programs one after another and would wait forever.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from blink_appliance.kernels.skinny_gemm import skinny_gemm

from bench.graph_timing import replay_us

HIDDEN, QKV = 2048, 3072
BUF = QKV  # every activation buffer holds the widest phase output


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program's writes so far are visible to every program after this; `target` is the
    number of arrivals this barrier completes (programs x barriers so far)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _gemv_run(x_ptr, w_ptr, out_ptr, N, u_lo, u_hi, KT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """out[n] += sum_k x[k] * w[k, n] over units u_lo..u_hi (unit u: n tile u // KT, K tile u % KT)."""
    t = tl.arange(0, 16)
    kk = tl.arange(0, BLOCK_K)
    u = u_lo
    while u < u_hi:
        nt = u // KT
        k_end = tl.minimum(u_hi, (nt + 1) * KT) - nt * KT
        n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        for kt in range(u - nt * KT, k_end):
            k = kt * BLOCK_K + kk
            w = tl.load(w_ptr + k[None, :] * N + n[:, None], eviction_policy="evict_first")
            x = tl.load(
                x_ptr + k[:, None] + t[None, :] * 0, mask=t[None, :] == 0, other=0.0, cache_modifier=".cg"
            )
            acc = tl.dot(w, x.to(w.dtype), acc)
        tl.atomic_add(out_ptr + n[:, None] + t[None, :] * 0, acc, mask=t[None, :] == 0, sem="relaxed")
        u = k_end + nt * KT


@triton.jit
def _persistent_chain_kernel(act_ptr, wq_ptr, wo_ptr, counter_ptr, layers, K: tl.constexpr,
                             NQ: tl.constexpr, NO: tl.constexpr, BUF: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, WORK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    KT: tl.constexpr = K // BLOCK_K
    clear = tl.arange(0, 1024)
    for p in range(2 * layers):
        src = act_ptr + (p % 3) * BUF
        dst = act_ptr + ((p + 1) % 3) * BUF
        spent = act_ptr + ((p + 2) % 3) * BUF  # the last phase's input: next phase's output, zeroed now
        for c in range(pid * 1024, BUF, programs * 1024):
            tl.store(spent + c + clear, tl.zeros([1024], tl.float32), mask=c + clear < BUF)
        if WORK:
            if p % 2 == 0:
                n_units = (NQ // BLOCK_N) * KT
                w = wq_ptr + (p // 2).to(tl.int64) * K * NQ
                _gemv_run(src, w, dst, NQ, pid * n_units // programs, (pid + 1) * n_units // programs,
                          KT, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                n_units = (NO // BLOCK_N) * KT
                w = wo_ptr + (p // 2).to(tl.int64) * K * NO
                _gemv_run(src, w, dst, NO, pid * n_units // programs, (pid + 1) * n_units // programs,
                          KT, BLOCK_N, BLOCK_K)  # fmt: skip
        _grid_barrier(counter_ptr, (p + 1) * programs)


@triton.jit
def _slice_pointers(w_ptr, N, lo, hi, U: tl.constexpr, KT: tl.constexpr, BLOCK: tl.constexpr):
    """Units lo..hi of a phase as one [U, BLOCK (k), BLOCK (n)] block of pointers, and which are real."""
    u = lo + tl.arange(0, U)
    nt = u // KT
    kt = u % KT
    b = tl.arange(0, BLOCK)
    k = kt[:, None, None] * BLOCK + b[None, :, None]
    n = nt[:, None, None] * BLOCK + b[None, None, :]
    return w_ptr + k * N + n, (u < hi)[:, None, None]


@triton.jit
def _resident_phase(w, src, dst, N, lo, hi, U: tl.constexpr, KT: tl.constexpr, BLOCK: tl.constexpr):
    """dst[n] += sum_k src[k] w[k, n] over the units lo..hi whose weights w [U, BLOCK, BLOCK] hold."""
    u = lo + tl.arange(0, U)
    nt = u // KT
    kt = u % KT
    b = tl.arange(0, BLOCK)
    real = u < hi
    x = tl.load(src + kt[:, None] * BLOCK + b[None, :], mask=real[:, None], other=0.0, cache_modifier=".cg")
    y = tl.sum(w.to(tl.float32) * x[:, :, None], axis=1)
    tl.atomic_add(dst + nt[:, None] * BLOCK + b[None, :], y, mask=real[:, None], sem="relaxed")


@triton.jit
def _resident_load(w_ptr, N, lo, hi, live, UA: tl.constexpr, UB: tl.constexpr, KT: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """A program's units lo..hi of a phase, loaded as two register blocks (UA + UB units: a run of 12
    units needs no 16-unit block)."""
    ptrs, real = _slice_pointers(w_ptr, N, lo, hi, UA, KT, BLOCK)
    w_a = tl.load(ptrs, mask=real & live, other=0.0, eviction_policy="evict_first")
    ptrs, real = _slice_pointers(w_ptr, N, lo + UA, hi, UB, KT, BLOCK)
    w_b = tl.load(ptrs, mask=real & live, other=0.0, eviction_policy="evict_first")
    return w_a, w_b


@triton.jit
def _resident_chain_kernel(act_ptr, wq_ptr, wo_ptr, counter_ptr, layers, K: tl.constexpr,
                           NQ: tl.constexpr, NO: tl.constexpr, BUF: tl.constexpr, UA: tl.constexpr,
                           UB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The persistent chain with each program's weights for a phase loaded into registers before the
    barrier that ends the phase before: the weight stream does not stop at a barrier."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    KT: tl.constexpr = K // BLOCK
    clear = tl.arange(0, 1024)
    q_units = (NQ // BLOCK) * KT
    o_units = (NO // BLOCK) * KT
    lo = pid * q_units // programs
    hi = (pid + 1) * q_units // programs
    w_a, w_b = _resident_load(wq_ptr, NQ, lo, hi, True, UA, UB, KT, BLOCK)
    for p in range(2 * layers):
        src = act_ptr + (p % 3) * BUF
        dst = act_ptr + ((p + 1) % 3) * BUF
        spent = act_ptr + ((p + 2) % 3) * BUF
        for c in range(pid * 1024, BUF, programs * 1024):
            tl.store(spent + c + clear, tl.zeros([1024], tl.float32), mask=c + clear < BUF)
        n = NQ if p % 2 == 0 else NO
        _resident_phase(w_a, src, dst, n, lo, hi, UA, KT, BLOCK)
        _resident_phase(w_b, src, dst, n, lo + UA, hi, UB, KT, BLOCK)
        # the next phase's weights, in flight while this phase's barrier waits
        layer = (p + 1) // 2
        if p % 2 == 0:
            lo = pid * o_units // programs
            hi = (pid + 1) * o_units // programs
            w_a, w_b = _resident_load(
                wo_ptr + layer.to(tl.int64) * K * NO, NO, lo, hi, True, UA, UB, KT, BLOCK
            )
        else:
            lo = pid * q_units // programs
            hi = (pid + 1) * q_units // programs
            w_a, w_b = _resident_load(wq_ptr + layer.to(tl.int64) * K * NQ, NQ, lo, hi, layer < layers,
                                      UA, UB, KT, BLOCK)  # fmt: skip
        _grid_barrier(counter_ptr, (p + 1) * programs)


def resident(act, wq, wo, counter, programs, units_a, units_b, warps):
    counter.zero_()
    _resident_chain_kernel[(programs,)](
        act, wq, wo, counter, wq.shape[0], K=HIDDEN, NQ=QKV, NO=HIDDEN, BUF=BUF, UA=units_a, UB=units_b, BLOCK=64,
        num_warps=warps, num_stages=1,
    )  # fmt: skip


def persistent(act, wq, wo, counter, programs, block_n, block_k, warps, stages, work=True):
    counter.zero_()
    _persistent_chain_kernel[(programs,)](
        act, wq, wo, counter, wq.shape[0], K=HIDDEN, NQ=QKV, NO=HIDDEN, BUF=BUF, BLOCK_N=block_n,
        BLOCK_K=block_k, WORK=work, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def reference(x0, wq, wo, round_input: bool = True) -> torch.Tensor:
    """The chain in fp32; each phase's input rounded to bf16 first (as the Triton kernels round it)."""
    x = x0.clone()
    dtype = torch.bfloat16 if round_input else torch.float32
    for layer in range(wq.shape[0]):
        x = x.to(dtype).float() @ wq[layer].float()
        x = x[:HIDDEN].to(dtype).float() @ wo[layer].float()
    return x


def chain(x, wq, wo, partials, stream):
    for layer in range(wq.shape[0]):
        skinny_gemm(x, wq[layer].t(), partials, split_k=4, block_k=64, pdl=True)
        skinny_gemm(x, wo[layer].t(), stream, split_k=4, accumulate=True, pdl=True)


def problem(layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random weights of the real shapes, scaled to keep the chain's norm, and the first input."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HIDDEN**-0.5
    wq = (torch.randn(layers, HIDDEN, QKV, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    wo = (torch.randn(layers, HIDDEN, HIDDEN, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    return wq, wo, torch.randn(HIDDEN, device="cuda", generator=gen)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = arguments()
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wq, wo, x0 = problem(args.layers)
    act = torch.zeros(3, BUF, device=dev)  # the phases' inputs and outputs, in turn
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    ref = reference(x0, wq, wo)

    def run(programs, block_n, block_k, warps, stages, work=True):
        def fn():
            act.zero_()
            act[0, :HIDDEN].copy_(x0)
            persistent(act, wq, wo, counter, programs, block_n, block_k, warps, stages, work)

        return fn

    def run_resident(programs, units_a, units_b, warps):
        def fn():
            act.zero_()
            act[0, :HIDDEN].copy_(x0)
            resident(act, wq, wo, counter, programs, units_a, units_b, warps)

        return fn

    rows = []
    x = x0.to(torch.bfloat16)[None]
    partials = torch.zeros(4, 1, QKV, device=dev)
    stream = torch.zeros(1, HIDDEN, device=dev)
    rows.append(
        {"variant": "chain (skinny_gemm, PDL)", "us": replay_us(lambda: chain(x, wq, wo, partials, stream))}
    )
    rows.append(
        {"variant": f"barriers only, {sms} programs", "us": replay_us(run(sms, 64, 64, 4, 3, work=False))}
    )
    rows.append(
        {"variant": "empty graph node (act reset)", "us": replay_us(lambda: (act.zero_(), counter.zero_()))}
    )
    variants = [("persistent programs={} block_n={} block_k={} warps={} stages={}".format(*v), run(*v))
                for v in ((sms, 128, 64, 4, 4), (2 * sms, 64, 64, 4, 3), (sms, 128, 64, 8, 6))]  # fmt: skip
    variants += [("resident programs={} units={}+{} warps={}".format(*v), run_resident(*v))
                 for v in ((sms, 8, 4, 16), (sms, 8, 4, 8), (sms, 8, 8, 16))]  # fmt: skip
    for label, fn in variants:
        fn()
        torch.cuda.synchronize()
        out = act[(2 * args.layers) % 3, :HIDDEN]
        err = ((out - ref).norm() / ref.norm()).item()
        arrivals = int(counter.item())
        programs = int(label.split("programs=")[1].split()[0])
        ok = err < 2e-2 and arrivals == programs * 2 * args.layers
        rows.append({"variant": label, "us": replay_us(fn) if ok else float("nan"), "rel_err": err,
                     "arrivals": arrivals})  # fmt: skip
    name = torch.cuda.get_device_name(0)
    print(f"## {name}, {args.layers} layers of QKV + O at one row, graph replay, us")
    for r in rows:
        extra = f"  err {r['rel_err']:.1e} arrivals {r['arrivals']}" if "rel_err" in r else ""
        print(f"{r['us']:9.1f}  {r['variant']}{extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": name, "layers": args.layers, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""The persistent chain of bench/persistent_chain.py in CUDA C++ (bench/persistent_chain.cu, NVRTC
through cupy), where a program can do what Triton does not let it: copy weights into shared memory
ahead of the grid barrier, so the weight stream need not stop at a barrier.

    PYTHONPATH=. python3 bench/persistent_chain_cuda.py [--layers 16] [--out FILE]

Work is cut into units (64 k x 64 n weight tiles); a phase gives every program an equal run of at
most 12 units, K tiles inner (stream-K). Four kernels:
- `resident_chain`: cp.async copies of the next run's slice into the other half of a 192 KB double
  buffer, issued before the barrier;
- `resident_bulk`: the same with one bulk (TMA) copy a run, from weights packed unit-major
  (`pack_units`), so a run is contiguous;
- `resident_ring`: warp 0 streams the packed units through a 24-stage ring and never waits on the
  barrier; 8 warps take the barrier, stage the phase's input from L2, multiply each unit as it lands
  and add each output tile's sums into the next buffer with atomics;
- `resident_flow`: the ring with no grid barrier: a buffer per phase, and a readiness word per
  output tile that each program adding into it counts itself in; a consumer warp starts a phase when
  the tiles it reads are complete.
Each is checked against torch, then timed beside `chain` (the forward's own PDL-chained skinny_gemm
kernels) in the same call. `skip` flags time the ring and the bulk kernel with parts left out (their
results are then wrong), and `ring_timeline` stamps the ring's phases on the SM clock.
"""

from __future__ import annotations

import json
from pathlib import Path

import cupy
import numpy as np
import torch

from bench.graph_timing import replay_us
from bench.persistent_chain import BUF, HIDDEN, QKV, arguments, chain, problem, reference

RING = 24  # resident_ring's stages of one unit
UNITS = 12  # the most units a program takes in a phase (QKV: 1536 units over 132 programs)
BLOCK = 64
THREADS = 256

SOURCE = (Path(__file__).parent / "persistent_chain.cu").read_text()


def pack_units(wq: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """Each layer's QKV then O weights as [64 k, 64 n] units, unit u = n tile * K tiles + k tile: every
    program's run of a phase is then one contiguous range (resident_bulk's one bulk copy)."""

    def units(w: torch.Tensor) -> torch.Tensor:
        k, n = w.shape
        return w.view(k // BLOCK, BLOCK, n // BLOCK, BLOCK).permute(2, 0, 1, 3).reshape(-1)

    return torch.cat([torch.cat([units(wq[i]), units(wo[i])]) for i in range(wq.shape[0])]).contiguous()


class ResidentChain:
    """kernel "resident_chain": cp.async copies from the [in, out] weights; "resident_bulk": one bulk
    copy per run from the unit-packed weights (`pack_units`)."""

    def __init__(self, kernel: str) -> None:
        self.module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
        self.name = kernel
        self.kernel = self.module.get_function(kernel)
        if kernel == "resident_ring":
            self.threads = THREADS + 32
            self.smem = RING * BLOCK * BLOCK * 2 + HIDDEN * 4 + 8 * BLOCK * 4 + 2 * RING * 8
        elif kernel == "resident_flow":
            self.threads = THREADS + 32
            self.smem = RING * BLOCK * BLOCK * 2 + 8 * BLOCK * 4 + 2 * RING * 8
        else:
            self.threads = THREADS
            self.smem = 2 * UNITS * BLOCK * BLOCK * 2 + HIDDEN * 4 + 4 * BLOCK * 4 + 16
        self.kernel.max_dynamic_shared_size_bytes = self.smem

    def __call__(self, act, weights, counter, programs, layers, skip=None, stamps=None) -> None:
        counter.zero_()
        stream = torch.cuda.current_stream()
        with cupy.cuda.ExternalStream(stream.cuda_stream):
            ptrs = (np.uint64(t.data_ptr()) for t in (act, *weights, counter))
            extra = () if skip is None else (np.int32(skip),)
            if self.name == "resident_ring":
                extra += (np.uint64(0 if stamps is None else stamps.data_ptr()),)
            self.kernel((programs,), (self.threads,), (*ptrs, np.int32(layers), *extra), shared_mem=self.smem)


STAMP_NAMES = ("start", "past barrier", "input staged", "waiting on units (a sum)", "last unit landed",
               "tile sums added", "producer: first issued", "producer: last issued")  # fmt: skip


def ring_timeline(ring, act, packed, counter, programs, layers, x0) -> dict:
    """One stamped run of resident_ring: per phase kind (QKV, O; layers 1..), the median over
    programs and phases of each stamp in us from the consumers' start of the phase (the producer's
    stamps go negative when it ran ahead), and the start-to-start period."""
    phases = 2 * layers
    stamps = torch.zeros(programs * phases * 8 + 4, dtype=torch.int64, device="cuda")
    act.zero_()
    act[0, :HIDDEN].copy_(x0)
    ring(act, (packed,), counter, programs, layers, 0, stamps)
    torch.cuda.synchronize()
    cal = stamps[-4:].tolist()
    ghz = (cal[3] - cal[1]) / (cal[2] - cal[0])
    st = stamps[:-4].view(programs, phases, 8).double() / (ghz * 1000)  # us
    rel = st - st[:, :, :1]
    rel[:, :, 3] = st[:, :, 3]  # a duration, not a time
    period = st[:, 1:, 0] - st[:, :-1, 0]  # phase p's start to phase p+1's
    out = {"sm_ghz": round(ghz, 3), "kernel_us": (cal[2] - cal[0]) / 1000}
    for kind, first in (("qkv", 2), ("o", 3)):
        med = rel[:, first::2].flatten(0, 1).median(dim=0).values
        out[kind] = {n: round(v, 3) for n, v in zip(STAMP_NAMES, med.tolist(), strict=True)}
        out[kind]["period"] = round(period[:, first::2].median().item(), 3)
    return out


def flow_row(act, packed, programs, layers, x0, ref) -> dict:
    """resident_flow checked, then timed: a buffer a phase (act [phases + 1, BUF]) and a readiness word
    per phase and output tile after the arrivals word."""
    flow = ResidentChain("resident_flow")
    counter = torch.zeros(1 + 2 * layers * (QKV // BLOCK), dtype=torch.int32, device="cuda")

    def fn() -> None:
        act.zero_()
        act[0, :HIDDEN].copy_(x0)
        flow(act, (packed,), counter, programs, layers)

    fn()
    torch.cuda.synchronize()
    out = act[2 * layers, :HIDDEN]
    err = ((out - ref).norm() / ref.norm()).item()
    arrivals = int(counter[0].item())
    ok = err < 2e-2 and arrivals == programs * 8
    return {"variant": f"cuda resident_flow, {programs} programs", "us": replay_us(fn) if ok else float("nan"),
            "rel_err": err, "arrivals": arrivals}  # fmt: skip


def main() -> None:
    args = arguments()
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wq, wo, x0 = problem(args.layers)
    ref = reference(x0, wq, wo, round_input=False)
    act = torch.zeros(3, BUF, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    packed = pack_units(wq, wo)
    if QKV // BLOCK * (HIDDEN // BLOCK) > UNITS * sms:
        raise SystemExit(f"{sms} SMs: a QKV run would exceed {UNITS} units")

    x = x0.to(torch.bfloat16)[None]
    partials = torch.zeros(4, 1, QKV, device=dev)
    stream = torch.zeros(1, HIDDEN, device=dev)
    rows = [
        {"variant": "chain (skinny_gemm, PDL)", "us": replay_us(lambda: chain(x, wq, wo, partials, stream))}
    ]
    kernels = (("resident_chain", (wq, wo)), ("resident_ring", (packed,)), ("resident_bulk", (packed,)))
    for kernel, weights in kernels:
        resident = ResidentChain(kernel)
        skip = None if kernel == "resident_chain" else 0

        def fn(resident=resident, weights=weights, skip=skip) -> None:
            act.zero_()
            act[0, :HIDDEN].copy_(x0)
            resident(act, weights, counter, sms, args.layers, skip)

        fn()
        torch.cuda.synchronize()
        out = act[(2 * args.layers) % 3, :HIDDEN]
        err = ((out - ref).norm() / ref.norm()).item()
        arrivals = int(counter.item())
        ok = err < 2e-2 and arrivals == sms * 2 * args.layers
        rows.append({"variant": f"cuda {kernel}, {sms} programs", "us": replay_us(fn) if ok else float("nan"),
                     "rel_err": err, "arrivals": arrivals})  # fmt: skip
    ring = ResidentChain("resident_ring")
    diagnostics = (("ring", 1, "barrier waits"), ("ring", 4, "multiply"), ("ring", 5, "waits, multiply"),
                   ("ring", 13, "waits, multiply, phase starts"), ("ring", 21, "barriers, multiply"),
                   ("ring", 37, "waits, multiply, zeroing"), ("ring", 69, "waits, multiply, input staging"),
                   ("ring", 117, "barriers, multiply, zeroing, staging"), ("ring", 128, ""),
                   ("ring", 133, "waits, multiply (release arrivals)"),
                   ("bulk", 2, "weight copies"), ("bulk", 6, "copies and multiply"))  # fmt: skip
    for kernel, skip, what in diagnostics:

        def timing_only(skip=skip, run=ring if kernel == "ring" else resident) -> None:
            run(act, (packed,), counter, sms, args.layers, skip)

        label = f"cuda resident_{kernel} without {what} (timing only)"
        row = {}
        if skip == 128:  # right results: checked
            label = f"cuda resident_{kernel} arriving with a release reduction"
            act.zero_()
            act[0, :HIDDEN].copy_(x0)
            timing_only()
            torch.cuda.synchronize()
            out = act[(2 * args.layers) % 3, :HIDDEN]
            row = {"rel_err": ((out - ref).norm() / ref.norm()).item(), "arrivals": int(counter.item())}
        rows.append({"variant": label, "us": replay_us(timing_only), **row})
    act_flow = torch.zeros(2 * args.layers + 1, BUF, device=dev)
    rows.append(flow_row(act_flow, packed, sms, args.layers, x0, ref))
    rows.append({"variant": "chain again", "us": replay_us(lambda: chain(x, wq, wo, partials, stream))})
    rows.append(
        {"variant": "empty graph node (act reset)", "us": replay_us(lambda: (act.zero_(), counter.zero_()))}
    )
    rows.append(
        {"variant": "empty graph node (resident_flow's reset)", "us": replay_us(lambda: act_flow.zero_())}
    )
    name = torch.cuda.get_device_name(0)
    print(f"## {name}, {args.layers} layers of QKV + O at one row, graph replay, us")
    for r in rows:
        extra = f"  err {r['rel_err']:.1e} arrivals {r['arrivals']}" if "rel_err" in r else ""
        print(f"{r['us']:9.1f}  {r['variant']}{extra}")
    timeline = ring_timeline(ring, act, packed, counter, sms, args.layers, x0)
    print(json.dumps(timeline, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"gpu": name, "layers": args.layers, "rows": rows, "ring_timeline": timeline}, f, indent=1
            )


if __name__ == "__main__":
    main()

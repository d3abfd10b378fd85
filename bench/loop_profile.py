"""Where one GPU-loop step's time goes, per loop geometry: schedule, forward, sample, commit.

On the H100 (one command; `dummy:llama-3.2-1b` bf16, random weights with the real shapes):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/loop_profile.py --out $OUT/loop_profile.json
CPU check of the script itself (the loop's kernels interpreted, ~10 s a forward; timings meaningless):
    TRITON_INTERPRET=1 .venv/bin/python bench/loop_profile.py --device cpu --model dummy:tiny \
        --geometries 64/8/8/32 --batches 1 4 --prompt-len 8 --steps 2

A geometry, max_model_len/num_slots/max_seqs/step budget, becomes a profile (engine.mode "host",
max_inflight = num_slots, kv_fraction as shipped) that the appliance's own derivations (resolve_plan,
loop_geometry, ring_geometry) turn into a LoopRig. Per geometry, batch 1 and 64 (at most max_seqs;
128-token prompts), greedy and sampled (temperature 0.7, top_p 0.9), host-driven:
- `--steps` pure decode steps, their pieces launched as LoopStep.host_step launches them and timed
  with CUDA events: schedule, the chosen bucket's forward graph, the sampler variant, commit. A GPU
  spin ahead of each span lets every launch of it queue first, so the events time device work only
  (`uncovered_spans` counts spans whose launches outlasted the spin); perf_counter on the CPU;
- one torch.profiler run of host_step(): the top kernels by device time (CPU ops on the CPU), and
  host_step() wall time: what engine.mode "host" pays a step, syncs included;
- on CUDA (unless --no-loop) the same requests through the DeviceLoop: TPOT from the ring's stamps.
Greedy batch-1 tokens of the first steps must agree between geometries (same prompt, same weights):
a difference fails the run unless the top two logits of that step were within --tie.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the loop's kernels run interpreted on the CPU

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402

from bench.loop_rig import LoopRig  # noqa: E402
from blink_appliance.engine.loop.geometry import loop_geometry  # noqa: E402
from blink_appliance.engine.loop.scheduler import PHASE_NAMES  # noqa: E402
from blink_appliance.engine.loop.step import LoopStep  # noqa: E402
from blink_appliance.engine.plan import resolve_plan  # noqa: E402
from blink_appliance.model.loaders import load_checkpoint  # noqa: E402
from blink_appliance.profile import parse_profile, ring_geometry  # noqa: E402
from blink_appliance.wire.client import EngineClient  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import EngineState, region_size  # noqa: E402

DEFAULT_GEOMETRIES = ["512/64/64/512", "8192/64/64/512", "8192/1024/256/2048", "32768/4096/256/2048"]
PIECES = ("schedule", "forward", "sample", "commit")


@dataclass(frozen=True)
class Case:
    batch: int
    sampled: bool
    logprobs: int | None = None  # every row asks for this many alternatives
    penalized: bool = False  # every row has repetition, frequency and presence penalties

    @property
    def name(self) -> str:
        lp = "" if self.logprobs is None else f"-lp{self.logprobs}"
        return f"b{self.batch}-{'sampled' if self.sampled else 'greedy'}{lp}{'-penalized' if self.penalized else ''}"

    def params(self, index: int, max_tokens: int) -> SamplingParams:
        random = dict(temperature=0.7, top_p=0.9, seed=index + 1) if self.sampled else dict(temperature=0.0)
        penalties = (
            dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
            if self.penalized
            else {}
        )
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, logprobs=self.logprobs, **random, **penalties
        )


class Clock:
    """Marks around a step's pieces: CUDA events on the GPU, each span started behind a GPU spin of
    `hold_ms` so that the host's launch time stays out of it; perf_counter on the CPU, where every
    piece runs synchronously."""

    def __init__(self, device: torch.device, hold_ms: float) -> None:
        self.cuda, self.hold_ms = device.type == "cuda", hold_ms
        self.marks: list = []
        self.uncovered = 0  # spans whose launches outlasted the spin
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
            for _ in range(2):  # the first spin also loads the kernel
                self.marks = []
                self.mark()
                torch.cuda._sleep(1_000_000)
                self.mark()
                torch.cuda.synchronize()
            self.cycles = int(1_000_000 * hold_ms / self.ms(0, 1))

    def start(self) -> None:
        if self.cuda:
            torch.cuda._sleep(self.cycles)
            self._launch_t0 = time.perf_counter()
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            self.events[len(self.marks)].record()
        self.marks.append(self.events[len(self.marks)] if self.cuda else time.perf_counter())

    def sync(self) -> None:
        if self.cuda:
            self.uncovered += (time.perf_counter() - self._launch_t0) * 1e3 > 0.8 * self.hold_ms
            torch.cuda.synchronize()

    def ms(self, i: int, j: int) -> float:
        a, b = self.marks[i], self.marks[j]
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def timed_step(step: LoopStep, clock: Clock) -> dict:
    """One loop iteration as host_step() runs it, each piece timed on its own."""
    clock.marks = []
    clock.start()
    step.schedule()
    clock.mark()
    clock.sync()
    index, variant = int(step.state.bucket_index[0]), int(step.state.sampler_index[0])
    phases = step.scheduler.phase_us() if step.scheduler.stamping else None
    ran = 0 <= index < len(step.geometry.buckets)
    clock.start()
    if ran:
        step.forward_bucket(index)
    clock.mark()
    samplers = step.sampler.variants()
    if ran and 0 <= variant < len(samplers):
        samplers[variant]()
    clock.mark()
    step.commit()
    clock.mark()
    clock.sync()
    times = dict(zip(PIECES, (clock.ms(0, 1), clock.ms(2, 3), clock.ms(3, 4), clock.ms(4, 5)), strict=True))
    bucket = step.geometry.buckets[index] if ran else 0
    return times | {
        "bucket": bucket, "sampler": variant, "tokens": int(step.state.step_num_tokens[0]), "phases": phases,
    }  # fmt: skip


def top_kernels(step: LoopStep, steps: int, n: int) -> list[dict]:
    """host_step() `steps` times under torch.profiler: the top kernels by device time (per step, us)."""
    cuda, kinds = step.state.keep_running.is_cuda, torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU]) as prof:
        for _ in range(steps):
            step.host_step()
    kernels = [e for e in prof.key_averages() if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
    rows = [
        {"name": e.key[:100], "calls_per_step": e.count / steps,
         "us_per_step": (e.self_device_time_total if cuda else e.self_cpu_time_total) / steps}
        for e in kernels
    ]  # fmt: skip
    if cuda:  # a kernel launched several times a step (the sampler's rounds): each launch apart
        calls: dict[str, list] = {}
        for e in sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start):  # fmt: skip
            calls.setdefault(e.name[:100], []).append(e.time_range.elapsed_us())
        for row in rows:
            k, times = round(row["calls_per_step"]), calls.get(row["name"], [])
            if 1 < k <= 8 and len(times) >= k:
                row["us_per_call_by_position"] = [round(statistics.median(times[j::k]), 1) for j in range(k)]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:n]


async def submit(rig: LoopRig, client: EngineClient, case: Case, plen: int, max_tokens: int) -> dict:
    """The case's requests, each streamed into a list of events by a task: {request id: (task, events)}."""
    rig.heartbeat()  # the client submits only to an engine whose heartbeat it saw advance
    ids, out = min(rig.step.geometry.vocab_size, 1000) - 3, {}
    for i in range(case.batch):
        tokens = [(i * 37 + j * 11) % ids + 3 for j in range(plen)]  # request 0: the same in every geometry
        rid, events = client.submit(tokens, case.params(i, max_tokens)), []

        async def collect(rid: int = rid, into: list = events) -> None:
            async for event in client.stream(rid):
                into.append(event)

        out[rid] = (asyncio.create_task(collect()), events)
    return out


async def host_case(rig: LoopRig, client: EngineClient, clock: Clock, case: Case, args, plen: int) -> dict:
    """One case, host-driven: prefill, warm-up, timed steps, a profiler run, host_step wall time."""
    step, state = rig.step, rig.step.state
    warmup, extra = min(5, args.steps), min(10, -(-args.steps // 2))  # extra: profiled, then wall-timed
    skew = -(-case.batch * plen // step.geometry.max_num_batched_tokens)  # steps until every prompt is in
    budget = skew + 2 + warmup + args.steps + 2 * extra + 8
    requests = await submit(rig, client, case, plen, budget)
    check: list[tuple[int, float]] = []  # greedy batch 1: (token, top-1 minus top-2 logit) per step
    clock.uncovered = 0

    def record_check() -> None:
        if case == Case(1, False) and len(check) < args.check_tokens and int(state.sample_slot[0]) >= 0:
            top = step.forward_runner.logits[0].topk(2).values.tolist()
            check.append((int(state.sampled[0]), top[0] - top[1]))

    async def beat(record: bool) -> int:
        rig.heartbeat()
        step.host_step()  # not rig.beat(): that one only watches when the rig holds a DeviceLoop
        if record:
            record_check()
        await asyncio.sleep(0)  # the client's pump reads the ring
        return int(state.step_num_tokens[0])

    decoding, steps_left, prefill = 0, skew + warmup + 50, []
    while decoding < warmup and (steps_left := steps_left - 1) >= 0:  # prefill steps timed too
        rig.heartbeat()
        timing = timed_step(step, clock)
        record_check()
        await asyncio.sleep(0)
        if timing["tokens"] > case.batch:
            prefill.append(timing)
        decoding = decoding + 1 if timing["tokens"] == case.batch else 0
    if decoding < warmup:
        raise RuntimeError(f"{case.name}: no run of {warmup} pure decode steps")
    timings = []
    for _ in range(args.steps):
        timings.append(timed_step(step, clock))
        record_check()
        await asyncio.sleep(0)
    kernels = top_kernels(step, extra, args.top)
    t0 = time.perf_counter()
    for _ in range(extra):
        step.host_step()
    wall_ms = (time.perf_counter() - t0) * 1e3 / extra
    for rid in requests:
        client.cancel(rid)
    deadline = time.monotonic() + 120
    while not all(task.done() for task, _ in requests.values()):
        await beat(False)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{case.name}: requests did not finish after the cancel")
    first = [e.token_id for e in next(iter(requests.values()))[1] if e.token_id is not None]
    if first[: len(check)] != [t for t, _ in check]:
        raise RuntimeError(f"{case.name}: the ring's tokens {first} differ from the loop state's {check}")
    if case.logprobs is not None:  # every token came with its row; greedy: the most likely one
        rows = [e.logprobs for e in next(iter(requests.values()))[1] if e.token_id is not None]
        if None in rows or len(rows) < len(first):
            raise RuntimeError(f"{case.name}: tokens came without their logprob rows")
        if not case.sampled and any(r.top and r.top[0][0] != r.token_id for r in rows):
            raise RuntimeError(f"{case.name}: a greedy token is not the most likely one of its row")
    median = {p: statistics.median(t[p] for t in timings) for p in PIECES}
    phases = None
    if timings[0]["phases"] is not None:  # --schedule-phases: each phase's median, in schedule order
        phases = {name: round(statistics.median(t["phases"][i] for t in timings), 2)
                  for i, name in enumerate(PHASE_NAMES)}  # fmt: skip
    return {
        "case": case.name, "batch": case.batch, "sampled": case.sampled, "logprobs": case.logprobs,
        "median_ms": median | {"total": statistics.median(sum(t[p] for p in PIECES) for t in timings)},
        "mean_ms": {p: statistics.fmean(t[p] for t in timings) for p in PIECES},
        "prefill_steps": len(prefill),  # steps that admitted and prefilled (schedule's lookups, registrations)
        "prefill_median_ms": {p: statistics.median(t[p] for t in prefill) for p in ("schedule", "forward")}
        | {"total": statistics.median(sum(t[p] for p in PIECES) for t in prefill)} if prefill else None,
        "buckets": sorted({t["bucket"] for t in timings}), "samplers": sorted({t["sampler"] for t in timings}),
        "steps_not_pure_decode": sum(t["tokens"] != case.batch for t in timings),
        "schedule_phases_us": phases, "uncovered_spans": clock.uncovered, "host_step_wall_ms": wall_ms, "top_kernels": kernels, "check": check,
    }  # fmt: skip


async def loop_case(rig: LoopRig, client: EngineClient, case: Case, args, plen: int) -> dict:
    """The same requests through the running DeviceLoop: TPOT from the ring's token stamps."""
    skip = -(-case.batch * plen // rig.step.geometry.max_num_batched_tokens) + 3
    requests = await submit(rig, client, case, plen, skip + args.steps)
    deadline = time.monotonic() + 60
    while not all(task.done() for task, _ in requests.values()):
        rig.beat()  # heartbeat; raises if the loop ended by itself
        if time.monotonic() > deadline:
            raise TimeoutError(f"{case.name}: the device loop did not finish the requests in 60 s")
        await asyncio.sleep(0.002)
    gaps = []
    for _, events in requests.values():
        stamps = [e.timestamp_ns for e in events if e.token_id is not None][skip:]
        gaps += [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:], strict=False)]
    tpot = {"loop_tpot_p50_ms": statistics.median(gaps)}
    return tpot | {"loop_tpot_p90_ms": statistics.quantiles(gaps, n=10)[-1]}


async def profile_geometry(spec: str, ckpt, args, plen: int) -> dict:
    """One geometry's cases; its profile is engine.mode "host" with the ring sized as `up` sizes it."""
    mml, slots, seqs, budget = (int(x) for x in spec.split("/"))
    model = {
        "name": "profiled", "source": args.model, "dtype": args.dtype, "device": args.device, "max_seqs": seqs,
        "max_model_len": mml, "max_num_batched_tokens": budget, "block_size": 16,
    }  # fmt: skip
    model |= {"kv_budget_gib": args.kv_gib} if args.kv_gib else {"kv_fraction": args.kv_fraction}
    engine = {"mode": "host", "num_slots": slots, "prefix_cache": not args.no_prefix_cache}
    frontend = {"max_inflight": slots}
    profile = parse_profile({"models": [model], "engine": engine, "frontend": frontend}, origin=spec)
    device = torch.device(args.device)
    gc.collect()  # the previous geometry's rig
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the plan reads the free memory
    plan = resolve_plan(profile.model, ckpt.config)
    geometry, ring = loop_geometry(profile, plan, ckpt.config), ring_geometry(profile)
    out: dict = {"spec": spec, "geometry": asdict(geometry), "ring": asdict(ring), "cases": []}
    shm = os.statvfs("/dev/shm")
    if region_size(ring) > shm.f_bavail * shm.f_frsize:  # a short tmpfs would fault (SIGBUS) on first touch
        return out | {"skipped": f"the ring needs {region_size(ring) >> 20} MiB, more than /dev/shm has"}
    t0 = time.monotonic()
    in_loop = device.type == "cuda" and not args.no_loop  # captured now, launched after the host cases
    rig = LoopRig.build(
        ring, geometry, checkpoint=ckpt, dtype=getattr(torch, args.dtype), device=device, in_loop=in_loop
    )
    out["build_s"] = round(time.monotonic() - t0, 1)
    print(f"[{spec}] built in {out['build_s']} s: {geometry}")
    client = rig.client()
    try:
        rig.heartbeat()
        rig.region.store("engine_state", EngineState.RUNNING)  # host-driven: no launch
        await client.start()
        clock = Clock(device, args.hold_ms)
        batches = sorted({min(b, geometry.max_num_seqs) for b in args.batches})
        cases = [
            Case(b, s, lp)
            for b in batches
            for s in (tuple(map(bool, args.sampled or (0, 1))))
            for lp in (None, *args.logprobs)
        ] + ([Case(b, False, None, True) for b in batches] if args.penalties else [])
        # Host-driven launches read these two per step; the loop's captured graph keeps its own.
        knobs = [
            (w, c, r)
            for w in args.schedule_warps or [rig.step.scheduler.num_warps]
            for c in args.commit_warps or [rig.step.committer.num_warps]
            for r in args.rejection_rounds or [rig.step.sampler.rejection_rounds]
        ]
        if args.schedule_phases:
            rig.step.scheduler.stamp_phases()
        for warps, commit_warps, rounds in knobs:
            rig.step.scheduler.num_warps, rig.step.sampler.rejection_rounds = warps, rounds
            rig.step.committer.num_warps = commit_warps
            for case in cases:
                result = await host_case(rig, client, clock, case, args, plen)
                knob = {"schedule_warps": warps, "commit_warps": commit_warps, "rejection_rounds": rounds}
                out["cases"].append(result | knob)
                print(f"[{spec}] {case.name} w{warps} c{commit_warps} r{rounds} at {time.monotonic() - t0:.0f} s: "
                      f"{json.dumps(result['median_ms'])}")  # fmt: skip
                if result["schedule_phases_us"]:
                    print(
                        f"[{spec}] {case.name} schedule phases, us: {json.dumps(result['schedule_phases_us'])}"
                    )
        if in_loop:
            rig.loop.launch()
            for case, result in zip(cases, out["cases"], strict=False):
                try:
                    result |= await loop_case(rig, client, case, args, plen)
                except (RuntimeError, TimeoutError) as e:  # keep the host-mode numbers
                    result["loop_error"] = str(e)
                    break
    finally:
        await client.close()
        rig.shut_down()
    return out


def compare_checks(results: list[dict], tie: float) -> list[str]:
    """Greedy batch-1 tokens of every geometry against the first one's. A difference fails unless the
    top two logits of that step were within `tie` in either run (a near-tie that rounding in another
    kernel configuration may flip); the streams no longer compare after it."""
    runs = [(r["spec"], c["check"]) for r in results for c in r["cases"] if c["case"] == "b1-greedy"]
    failures = []
    for spec, check in runs[1:]:
        for i, ((a, gap_a), (b, gap_b)) in enumerate(zip(runs[0][1], check, strict=False)):
            if a != b:
                what = f"{spec} token {i}: {b} != {a} of {runs[0][0]} (top-2 gaps {gap_b:.4f}, {gap_a:.4f})"
                if min(gap_a, gap_b) > tie:
                    failures.append(what)
                else:
                    print(f"note, a near-tie: {what}")
                break
    return failures


def table(results: list[dict]) -> str:
    head = "| geometry | case | schedule | forward [bucket] | sample | commit | total | host_step wall | loop TPOT |"
    lines = [head, "|" + " --- |" * 9]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['spec']} | skipped: {r['skipped']} |" + " |" * 7)
        for c in r["cases"]:
            m, tpot = c["median_ms"], c.get("loop_tpot_p50_ms")
            lines.append(
                f"| {r['spec']} | {c['case']} w{c['schedule_warps']} c{c['commit_warps']} r{c['rejection_rounds']} | {m['schedule']:.3f} | {m['forward']:.3f} {c['buckets']} | "
                f"{m['sample']:.3f} | {m['commit']:.3f} | {m['total']:.3f} | {c['host_step_wall_ms']:.3f} | "
                f"{'-' if tpot is None else f'{tpot:.3f}'} |"
            )
    lines.append("\nms, medians over the timed steps. Top kernels per case (us per step, x calls per step):")
    for r in results:
        for c in r["cases"]:
            top = [
                f"{k['name'][:60]} {k['us_per_step']:.1f} x{k['calls_per_step']:g}"
                for k in c["top_kernels"][:6]
            ]
            lines.append(f"  {r['spec']} {c['case']}: " + "; ".join(top))
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--geometries", nargs="+", default=DEFAULT_GEOMETRIES, help="mml/slots/seqs/budget")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64], help="capped at max_seqs")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per case")
    ap.add_argument("--top", type=int, default=12, help="kernels kept per case")
    ap.add_argument("--check-tokens", type=int, default=8, help="greedy batch-1 tokens compared")
    ap.add_argument("--tie", type=float, default=0.05, help="top-2 logit gap under which tokens may differ")
    ap.add_argument("--hold-ms", type=float, default=3.0, help="GPU spin ahead of each timed span")
    ap.add_argument("--kv-fraction", type=float, default=0.85, help="of free memory, as the shipped profile")
    ap.add_argument("--kv-gib", type=float, default=None, help="a fixed KV budget instead")
    ap.add_argument("--no-loop", action="store_true", help="skip the DeviceLoop TPOT run")
    ap.add_argument("--schedule-warps", nargs="+", type=int, default=None, help="host-driven cases per value")
    ap.add_argument("--commit-warps", nargs="+", type=int, default=None, help="host-driven cases per value")
    ap.add_argument(
        "--rejection-rounds", nargs="+", type=int, default=None, help="host-driven cases per value"
    )
    ap.add_argument("--sampled", nargs="+", type=int, choices=(0, 1), default=None, help="default: 0 1")
    ap.add_argument(
        "--logprobs", nargs="*", type=int, default=[], help="also each case with logprobs=N on every row"
    )
    ap.add_argument("--penalties", action="store_true", help="also greedy cases with penalties on every row")
    ap.add_argument(
        "--schedule-phases", action="store_true",
        help="host-driven cases stamp each schedule phase (a barrier each: schedule's own time grows)",
    )  # fmt: skip
    ap.add_argument("--no-prefix-cache", action="store_true", help="[engine] prefix_cache = false")
    out = Path(os.environ["OUT"]) / "loop_profile.json" if os.environ.get("OUT") else None
    ap.add_argument("--out", type=Path, default=out, help="JSON report (default $OUT/loop_profile.json)")
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs the loop's kernels under the Triton interpreter: set TRITON_INTERPRET=1")
    return args


def main() -> None:
    args = arguments()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show while the run goes on
    cuda = args.device.startswith("cuda")
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu (TRITON_INTERPRET=1)"
    header = f"{gpu}; torch {torch.__version__}, triton {triton.__version__}; {args.model} {args.dtype}"
    print(header)
    t0 = time.monotonic()
    ckpt = load_checkpoint(args.model, seed=0)
    plen = min([args.prompt_len] + [int(s.split("/")[0]) // 2 for s in args.geometries])  # one prompt for all
    print(f"checkpoint in {time.monotonic() - t0:.1f} s; {plen}-token prompts")
    report = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "args": vars(args)}
    results: list[dict] = []
    for spec in args.geometries:
        try:
            results.append(asyncio.run(profile_geometry(spec, ckpt, args, plen)))
        except torch.OutOfMemoryError as e:
            results.append({"spec": spec, "cases": [], "skipped": f"out of memory: {str(e).splitlines()[0]}"})
        print(f"[{spec}] done at {time.monotonic() - t0:.0f} s")
        if args.out is not None:  # after every geometry: a later failure keeps the earlier ones
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report | {"results": results}, indent=1, default=str))
    report["check_failures"] = failures = compare_checks(results, args.tie)
    if args.out is not None:
        args.out.write_text(json.dumps(report | {"results": results}, indent=1, default=str))
    print(header + "\n" + table(results))
    if failures:
        sys.exit("FAILED: greedy batch-1 tokens differ between geometries:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()

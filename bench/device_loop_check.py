"""Device-loop mechanism on the GPU, one device call: what loop control costs, how fast an idle loop
wakes and stops, and what idling costs in power.

    python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 -m pytest tests/test_device_loop.py -q          # correctness (routing, wake, stop)
    PYTHONUNBUFFERED=1 python3 bench/device_loop_check.py --out $OUT

1. Mapped ring: a Triton kernel spinning on a mapped word (volatile loads) sees a host write.
2. Loop-control overhead: a WHILE loop whose body is one tiny torch op (+ the wait kernel, which returns
   at once, and set_while), with 0 and 2 SWITCH nodes that run no branch: time per iteration.
3. Forward in the loop (device_loop_forward.py): `dummy:smollm2-135m` bf16, a 4-sequence decode step in bucket 8, run as the
   SWITCH branch of the loop with a stand-in schedule/commit around it, vs the same bucket graph
   replayed from the host; the loop's logits must equal the replay's. Then shutdown while busy.
4. Wake-up latency: the loop idles in wait_and_set_while; another process (the front end's role) writes
   req_head after a random pause and spins until the loop's stand-in schedule writes req_tail back:
   round trip, and one-way (device %globaltimer stamp minus host write time, clock offset measured
   before the launch). Per backoff cap; then shutdown latency from idle.
5. Idle power (NVML energy counter): no loop, loop idling per backoff cap, loop spinning without sleep.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.device_loop_forward import (  # noqa: E402
    DecodeStep,
    busy_shutdown_ms,
    forward_in_loop,
    host_replay_ms,
    minimal_loop_ms,
)
from blink_appliance.wire.region import RingRegion  # noqa: E402
from blink_appliance.wire.ring_layout import RingGeometry, region_size  # noqa: E402
from blink_appliance.wire.shm_transport import ShmTransport  # noqa: E402

if TYPE_CHECKING:  # torch loads in the phases only: the front end's process (spawned) stays torch-free
    import torch

    from blink_appliance.engine.loop.control import Backoff, LoopControl
    from blink_appliance.engine.loop.graph import DeviceLoop
    from blink_appliance.engine.loop.mapped_region import MappedRegion, RingWords

GEOMETRY = RingGeometry(
    request_slots=16, arena_tokens=4096, max_prompt_tokens=1024, max_inflight=16, max_output_tokens=64
)
BACKOFF_CAPS = (0, 20_000, 100_000, 200_000)  # the idle loop's sleep caps (ns) measured for wake-up (4.)


@triton.jit(do_not_specialize=["want"])
def spin_until(word, want, out):
    """Spin on a (mapped) word with volatile loads until it holds `want`, then store it to out."""
    v = tl.load(word, volatile=True)
    while v != want:
        v = tl.load(word, volatile=True)
    tl.store(out, v)


# -- the front end's role, in its own process (no torch) --------------------------------------------
def front_end(name: str, conn) -> None:
    """Per command (first_k, n, min_gap_s, max_gap_s): publish req_head = k after a random pause and
    spin until req_tail == k; reply with (k, t_write_ns, t_seen_ns) per k."""
    transport = ShmTransport.open(name)
    region = RingRegion.attach(transport, GEOMETRY)
    rng = random.Random(7)
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        first, n, lo, hi = cmd
        out = []
        for k in range(first, first + n):
            time.sleep(rng.uniform(lo, hi))
            t0 = time.monotonic_ns()
            region.doorbell("req_head", k)
            while region.load("req_tail") != k:
                pass
            out.append((k, t0, time.monotonic_ns()))
        conn.send(out)
    transport.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


@dataclass
class Rig:
    """What every phase shares: the ring region in shared memory, its device mapping, the loop control."""

    dev: torch.device
    name: str
    transport: ShmTransport
    region: RingRegion
    mapped: MappedRegion
    words: RingWords
    control: LoopControl

    @classmethod
    def create(cls, dev: torch.device) -> Rig:
        from blink_appliance.engine.loop.control import LoopControl
        from blink_appliance.engine.loop.mapped_region import MappedRegion, RingWords

        name = f"blink-bench-loop-{os.getpid()}"
        transport = ShmTransport.create(name, region_size(GEOMETRY))
        region = RingRegion.create(transport, GEOMETRY)
        mapped = MappedRegion.of_transport(transport, dev)
        return cls(dev, name, transport, region, mapped, RingWords.of(mapped), LoopControl(dev))

    def i32(self, v: int) -> torch.Tensor:
        import torch

        return torch.full((1,), v, dtype=torch.int32, device=self.dev)

    def reset_ring(self) -> None:
        self.region.store("shutdown", 0)
        self.region.store("req_tail", self.region.load("req_head"))

    def close(self) -> None:
        self.mapped.close()
        self.transport.close()


# -- 1. Triton polling a mapped word ---------------------------------------------------------------
def mapped_poll(rig: Rig) -> bool:
    """Whether a Triton kernel spinning on the mapped req_head sees the host's write."""
    import torch

    dev, words, region = rig.dev, rig.words, rig.region
    seen = torch.zeros(1, dtype=torch.int64, device=dev)
    side = torch.cuda.Stream(dev)
    spin_until[(1,)](words.req_head, 0, seen)  # compile first
    with torch.cuda.stream(side):
        spin_until[(1,)](words.req_head, 4242, seen)
    time.sleep(0.05)
    was_spinning = not side.query()
    region.doorbell("req_head", 4242)
    side.synchronize()
    saw_write = was_spinning and int(seen.item()) == 4242
    region.store("req_head", 0)
    rig.reset_ring()
    print(f"[1] Triton volatile poll of a mapped ring word saw the host write: {saw_write}")
    return saw_write


# -- 2. Loop-control overhead ---------------------------------------------------------------------
def counting_loop(rig: Rig, n: int, switches: int) -> float:
    """Seconds for n iterations of a WHILE loop whose body counts, with `switches` SWITCH nodes that
    run no branch."""
    import torch

    from blink_appliance.engine.loop.graph import DeviceLoop, Switch

    counter = torch.zeros(1, dtype=torch.int64, device=rig.dev)
    keep, none = rig.i32(1), rig.i32(1)
    scratch = torch.zeros(1, device=rig.dev)

    def count() -> None:
        counter.add_(1)
        keep.copy_(counter < n)

    body = [count] + [Switch(f"s{i}", none, [[lambda: scratch.add_(1)]]) for i in range(switches)]
    loop = DeviceLoop(body, num_active=rig.i32(1), keep_running=keep, ring=rig.words, control=rig.control)
    t0 = time.perf_counter()
    loop.launch()
    assert loop.join(timeout_s=60)
    dt = time.perf_counter() - t0
    assert int(counter.item()) == n and float(scratch.item()) == 0.0
    loop.close()
    return dt


def loop_overhead(rig: Rig) -> dict[int, float]:
    """Microseconds per loop iteration, per number of empty SWITCH nodes (0 and 2)."""
    overhead = {}
    for switches in (0, 2):
        counting_loop(rig, 10, switches)  # warm-up (launch path)
        short, long_ = counting_loop(rig, 1, switches), counting_loop(rig, 20001, switches)
        overhead[switches] = (long_ - short) / 20000 * 1e6
        print(f"[2] WHILE loop, {switches} empty SWITCH nodes: {overhead[switches]:.2f} us per iteration")
    return overhead


# -- 4. Wake-up latency from another process -----------------------------------------------------
@dataclass
class WakeStamps:
    """Device buffers of the idle loop's stand-in schedule: stamps[k] is the %globaltimer at which it
    consumed record k (index max_k collects the passes that found nothing new)."""

    max_k: int
    stamps: torch.Tensor
    now: torch.Tensor
    head: torch.Tensor

    @classmethod
    def allocate(cls, dev: torch.device, max_k: int = 4096) -> WakeStamps:
        import torch

        stamps = torch.zeros(max_k + 1, dtype=torch.int64, device=dev)
        now = torch.zeros(1, dtype=torch.int64, device=dev)
        head = torch.zeros(1, dtype=torch.int64, device=dev)
        return cls(max_k, stamps, now, head)


def idle_loop(rig: Rig, probe: WakeStamps, backoff: Backoff) -> tuple[DeviceLoop, torch.Tensor]:
    """A loop with no active sequence: it idles in wait_and_set_while until req_head moves, then stamps and
    consumes every published record. Returns the loop and its iteration counter."""
    import torch

    from blink_appliance.engine.loop.graph import DeviceLoop

    words, control, max_k = rig.words, rig.control, probe.max_k
    iterations = torch.zeros(1, dtype=torch.int64, device=rig.dev)
    keep = rig.i32(1)

    def schedule() -> None:  # stand-in: stamp, then consume every published record
        probe.head.copy_(words.req_head)
        control.stamp_globaltimer(probe.now)
        slot = torch.where(probe.head != words.req_tail, probe.head, max_k).clamp_(0, max_k)
        probe.stamps.index_copy_(0, slot, probe.now)
        words.req_tail.copy_(probe.head)
        iterations.add_(1)
        keep.copy_(words.shutdown == 0)

    loop = DeviceLoop(
        [schedule], num_active=rig.i32(0), keep_running=keep, ring=words, control=control, backoff=backoff
    )
    return loop, iterations


def wake_latency(rig: Rig, probe: WakeStamps, offset_ns: int) -> tuple[dict[int, dict], dict[int, float]]:
    """Per backoff cap: wake-up round trip and one-way latency (us) over 80 wakes from another
    process, and the stop-from-idle time (ms)."""
    from blink_appliance.engine.loop.control import Backoff

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=front_end, args=(rig.name, child), daemon=True)
    writer.start()
    wake = {}
    idle_stop = {}
    k = rig.region.load("req_head") + 1
    n_wakes = 80
    for cap in BACKOFF_CAPS:
        backoff = Backoff(min(1_000, cap), cap)
        loop, iterations = idle_loop(rig, probe, backoff)
        loop.launch()
        parent.send((k, n_wakes, 0.002, 0.008))
        rows = parent.recv()
        stamps_host = probe.stamps.cpu()  # another stream: the loop (non-blocking stream) keeps running
        time.sleep(0.02)
        t0 = time.perf_counter()
        loop.stop(timeout_s=1.0)
        idle_stop[cap] = (time.perf_counter() - t0) * 1e3
        assert int(iterations.item()) == n_wakes + 1, (int(iterations.item()), n_wakes)
        loop.close()
        rig.reset_ring()
        rtt = [(t1 - t0_) / 1e3 for _, t0_, t1 in rows]
        one_way = [(int(stamps_host[kk]) + offset_ns - t0_) / 1e3 for kk, t0_, _ in rows]
        wake[cap] = {
            "round_trip_us": {
                "p50": pct(rtt, 50),
                "p99": pct(rtt, 99),
                "max": max(rtt),
                "mean": statistics.mean(rtt),
            },
            "one_way_us": {
                "p50": pct(one_way, 50),
                "p99": pct(one_way, 99),
                "max": max(one_way),
                "min": min(one_way),
            },
        }
        k += n_wakes
        print(
            f"[4] backoff cap {cap / 1e3:5.0f} us: wake round trip p50 {pct(rtt, 50):6.1f} p99 {pct(rtt, 99):6.1f} "
            f"max {max(rtt):6.1f} us; one-way p50 {pct(one_way, 50):6.1f} us; stop from idle {idle_stop[cap]:.2f} ms"
        )
    parent.send(None)
    writer.join(timeout=5)
    return wake, idle_stop


# -- 5. Idle power ----------------------------------------------------------------------------------
def measure_power(nvml: Any, seconds: float) -> dict[str, Any]:
    """NVML over `seconds` (after a second to settle): mean watts from the energy counter and sampled,
    median SM clock and utilization, the performance state."""
    import pynvml

    time.sleep(1.0)  # settle
    e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(nvml), time.monotonic()
    samples, clocks, utils = [], [], []
    while time.monotonic() - t0 < seconds:
        samples.append(pynvml.nvmlDeviceGetPowerUsage(nvml) / 1e3)
        clocks.append(pynvml.nvmlDeviceGetClockInfo(nvml, pynvml.NVML_CLOCK_SM))
        utils.append(pynvml.nvmlDeviceGetUtilizationRates(nvml).gpu)
        time.sleep(0.05)
    e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(nvml), time.monotonic()
    return {
        "watts_energy": (e1 - e0) / 1e3 / (t1 - t0),
        "watts_sampled_mean": statistics.mean(samples),
        "sm_clock_mhz_median": statistics.median(clocks),
        "gpu_util_pct_median": statistics.median(utils),
        "pstate": int(pynvml.nvmlDeviceGetPerformanceState(nvml)),
    }


def idle_power(rig: Rig, probe: WakeStamps, nvml: Any, seconds: float) -> dict[str, dict[str, Any]]:
    """Power with no loop, with the loop idling per backoff cap and spinning without sleep, no loop again."""
    from blink_appliance.engine.loop.control import Backoff

    power = {"no loop": measure_power(nvml, seconds)}
    for label, backoff in (
        ("loop idle, cap 100 us", Backoff(1_000, 100_000)),
        ("loop idle, cap 20 us", Backoff(1_000, 20_000)),
        ("loop idle, no sleep (spin)", Backoff(0, 0)),
    ):
        loop, _ = idle_loop(rig, probe, backoff)
        loop.launch()
        power[label] = measure_power(nvml, seconds)
        loop.stop(timeout_s=1.0)
        loop.close()
        rig.reset_ring()
    power["no loop (again)"] = measure_power(nvml, seconds)
    return power


def print_summary(results: dict[str, Any]) -> None:
    """The power and wake-up tables and a one-line summary, from the results document."""
    print("\n| state | W (energy counter) | W (sampled) | SM MHz | util % | pstate |")
    print("|---|---|---|---|---|---|")
    for label, p in results["power"].items():
        print(
            f"| {label} | {p['watts_energy']:.1f} | {p['watts_sampled_mean']:.1f} | "
            f"{p['sm_clock_mhz_median']:.0f} | {p['gpu_util_pct_median']:.0f} | P{p['pstate']} |"
        )
    print("\n| backoff cap | wake RTT p50 | p99 | max | one-way p50 | stop from idle |")
    print("|---|---|---|---|---|---|")
    for cap in BACKOFF_CAPS:
        w, idle_stop_ms = results["wake"][str(cap)], results["shutdown_idle_ms"][str(cap)]
        print(
            f"| {cap / 1e3:.0f} us | {w['round_trip_us']['p50']:.1f} us | {w['round_trip_us']['p99']:.1f} us | "
            f"{w['round_trip_us']['max']:.1f} us | {w['one_way_us']['p50']:.1f} us | {idle_stop_ms:.2f} ms |"
        )
    overhead, fwd = results["loop_overhead_us"], results["forward_in_loop"]
    print(
        f"\nloop control: {overhead['0_switches']:.2f} us/iteration (0 switches), "
        f"{overhead['2_switches']:.2f} (2 empty switches); "
        f"forward in loop {fwd['loop_us']:.1f} (minimal loop {fwd['minimal_loop_us']:.1f}) vs replay "
        f"{fwd['host_replay_us']:.1f} us/step; "
        f"busy shutdown {results['shutdown_busy_ms']:.2f} ms; "
        f"clock offset +-{results['clock_offset_uncertainty_ns'] / 1e3:.1f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--power-seconds", type=float, default=5.0)
    args = ap.parse_args()

    import pynvml
    import torch

    dev = torch.device("cuda", 0)
    results: dict = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    pynvml.nvmlInit()
    nvml = pynvml.nvmlDeviceGetHandleByIndex(0)
    results["driver"] = pynvml.nvmlSystemGetDriverVersion()

    rig = Rig.create(dev)
    results["triton_mapped_poll"] = mapped_poll(rig)
    results["loop_overhead_us"] = {f"{k}_switches": v for k, v in loop_overhead(rig).items()}
    step = DecodeStep.build(dev)
    replay_ms = host_replay_ms(step)
    results["forward_in_loop"] = forward_in_loop(rig, step, replay_ms, minimal_loop_ms(rig, step))
    results["shutdown_busy_ms"] = busy_shutdown_ms(rig, step)
    offset_ns, results["clock_offset_uncertainty_ns"] = rig.control.measure_clock_offset_ns()
    probe = WakeStamps.allocate(dev)
    wake, idle_stop = wake_latency(rig, probe, offset_ns)
    results["wake"] = {str(c): v for c, v in wake.items()}
    results["shutdown_idle_ms"] = {str(c): v for c, v in idle_stop.items()}
    results["power"] = idle_power(rig, probe, nvml, args.power_seconds)

    print_summary(results)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "device_loop_check.json").write_text(json.dumps(results, indent=2))
    rig.close()


if __name__ == "__main__":
    main()

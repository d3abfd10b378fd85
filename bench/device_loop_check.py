"""Device-loop mechanism on the GPU, one device call: what loop control costs, how fast an idle loop
wakes and stops, and what idling costs in power.

    python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 -m pytest tests/test_device_loop.py -q          # correctness (routing, wake, stop)
    PYTHONUNBUFFERED=1 python3 bench/device_loop_check.py --out $OUT

1. Mapped ring: a Triton kernel spinning on a mapped word (volatile loads) sees a host write.
2. Loop-control overhead: a WHILE loop whose body is one tiny torch op (+ the wait kernel, which returns
   at once, and set_while), with 0 and 2 SWITCH nodes that run no branch: time per iteration.
3. Forward in the loop: `dummy:smollm2-135m` bf16, a 4-sequence decode step in bucket 8, run as the
   SWITCH branch of the loop with a stand-in schedule/commit around it, vs the same bucket graph
   replayed from the host; the loop's logits must equal the replay's. Then shutdown while busy.
4. Wake-up latency: the loop idles in wait_for_work; another process (the front end's role) writes
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
from pathlib import Path

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink_appliance.transport.region import RingRegion  # noqa: E402
from blink_appliance.transport.ring_layout import RingGeometry, region_size  # noqa: E402
from blink_appliance.transport.shm_transport import ShmTransport  # noqa: E402

GEOMETRY = RingGeometry(
    request_slots=16, arena_tokens=4096, max_prompt_tokens=1024, max_inflight=16, max_output_tokens=64
)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--power-seconds", type=float, default=5.0)
    args = ap.parse_args()

    import pynvml
    import torch

    from blink_appliance.engine.cuda_graphs import ForwardGraphs
    from blink_appliance.engine.device_loop import DeviceLoop, RawGraph, Switch
    from blink_appliance.engine.loop_control import Backoff, LoopControl
    from blink_appliance.model.gpu_forward import GpuForward, GpuWeights
    from blink_appliance.model.kv_cache import PagedKVCache
    from blink_appliance.model.loaders.dummy import preset_config
    from blink_appliance.transport.mapped_region import MappedRegion, RingWords
    from tests.model_helpers import PagedSequences

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

    def i32(v: int) -> torch.Tensor:
        return torch.full((1,), v, dtype=torch.int32, device=dev)

    name = f"blink-bench-loop-{os.getpid()}"
    transport = ShmTransport.create(name, region_size(GEOMETRY))
    region = RingRegion.create(transport, GEOMETRY)
    mapped = MappedRegion.of_transport(transport, dev)
    words = RingWords.of(mapped)
    control = LoopControl(dev)

    def reset_ring() -> None:
        region.store("shutdown", 0)
        region.store("req_tail", region.load("req_head"))

    # 1. Triton polling a mapped word ---------------------------------------------------------------
    seen = torch.zeros(1, dtype=torch.int64, device=dev)
    side = torch.cuda.Stream(dev)
    spin_until[(1,)](words.req_head, 0, seen)  # compile first
    with torch.cuda.stream(side):
        spin_until[(1,)](words.req_head, 4242, seen)
    time.sleep(0.05)
    was_spinning = not side.query()
    region.doorbell("req_head", 4242)
    side.synchronize()
    results["triton_mapped_poll"] = was_spinning and int(seen.item()) == 4242
    region.store("req_head", 0)
    reset_ring()
    print(
        f"[1] Triton volatile poll of a mapped ring word saw the host write: {results['triton_mapped_poll']}"
    )

    # 2. Loop-control overhead ---------------------------------------------------------------------
    def counting_loop(n: int, switches: int) -> float:
        counter = torch.zeros(1, dtype=torch.int64, device=dev)
        keep, none = i32(1), i32(1)
        scratch = torch.zeros(1, device=dev)

        def count() -> None:
            counter.add_(1)
            keep.copy_(counter < n)

        body = [count] + [Switch(f"s{i}", none, [[lambda: scratch.add_(1)]]) for i in range(switches)]
        loop = DeviceLoop(body, num_active=i32(1), keep_running=keep, ring=words, control=control)
        t0 = time.perf_counter()
        loop.launch()
        assert loop.join(timeout_s=60)
        dt = time.perf_counter() - t0
        assert int(counter.item()) == n and float(scratch.item()) == 0.0
        loop.close()
        return dt

    overhead = {}
    for switches in (0, 2):
        counting_loop(10, switches)  # warm-up (launch path)
        short, long_ = counting_loop(1, switches), counting_loop(20001, switches)
        overhead[switches] = (long_ - short) / 20000 * 1e6
        print(f"[2] WHILE loop, {switches} empty SWITCH nodes: {overhead[switches]:.2f} us per iteration")
    results["loop_overhead_us"] = {f"{k}_switches": v for k, v in overhead.items()}

    # 3. Forward in the loop vs host replay --------------------------------------------------------
    cfg = preset_config("smollm2-135m")
    block, nblocks, max_blocks = 16, 256, 16
    kv = PagedKVCache.allocate(
        cfg.num_layers, nblocks, block, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev
    )
    fwd = GpuForward(
        cfg, GpuWeights.random(cfg, torch.bfloat16, dev, seed=1), kv,
        max_tokens=128, max_seqs=8, max_blocks_per_seq=max_blocks,
    )  # fmt: skip
    graphs = ForwardGraphs(fwd, (8, 128))
    graphs.capture()
    seqs = PagedSequences(nblocks, block, max_blocks, seed=3)
    prompts = [(s, [(s * 31 + i * 7) % cfg.vocab_size for i in range(25 + 3 * s)]) for s in range(4)]
    prefill = seqs.batch(prompts)
    fwd.load_batch(prefill, 128)
    graphs.replay(128)
    decode = seqs.batch([(s, [100 + s]) for s in range(4)])
    R = decode.sample_rows.shape[0]
    fwd.load_batch(decode, 8)
    want = graphs.replay(8)[:R].clone()

    g8 = graphs.graphs[8]
    for _ in range(20):
        g8.replay()
    torch.cuda.synchronize()
    n_steps = 1000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n_steps):
        g8.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / n_steps

    def forward_loop(n: int) -> tuple[DeviceLoop, torch.Tensor]:
        it = torch.zeros(1, dtype=torch.int64, device=dev)
        keep, bucket_index, sampler_index = i32(1), i32(0), i32(0)
        sampled = torch.zeros(R, dtype=torch.int64, device=dev)

        def schedule() -> None:  # stand-in: always the decode step in bucket 8, greedy
            bucket_index.fill_(0)
            sampler_index.fill_(0)

        def commit() -> None:
            it.add_(1)
            keep.copy_((it < n) & (words.shutdown == 0))

        body = [
            schedule,
            Switch("bucket", bucket_index, [[RawGraph(graphs.raw_cuda_graph(T))] for T in graphs.buckets]),
            Switch("sampler", sampler_index, [[lambda: sampled.copy_(fwd.logits[:R].argmax(-1))]]),
            commit,
        ]
        return DeviceLoop(body, num_active=i32(1), keep_running=keep, ring=words, control=control), it

    def minimal_forward_loop(n: int) -> DeviceLoop:
        it = torch.zeros(1, dtype=torch.int64, device=dev)
        keep, bucket_index = i32(1), i32(0)

        def count() -> None:
            it.add_(1)
            keep.copy_(it < n)

        body = [Switch("bucket", bucket_index, [[RawGraph(graphs.raw_cuda_graph(8))]]), count]
        return DeviceLoop(body, num_active=i32(1), keep_running=keep, ring=words, control=control)

    minimal_ms = {}
    for n in (10, 1, n_steps + 1):
        loop = minimal_forward_loop(n)
        t0 = time.perf_counter()
        loop.launch()
        assert loop.join(timeout_s=60)
        minimal_ms[n] = (time.perf_counter() - t0) * 1e3
        loop.close()
    minimal_loop_ms = (minimal_ms[n_steps + 1] - minimal_ms[1]) / n_steps
    print(
        f"[3] minimal loop (wait, SWITCH -> bucket 8, count, set_while): {minimal_loop_ms * 1e3:.1f} us/step"
    )

    loop, it = forward_loop(10)
    loop.launch()
    assert loop.join(timeout_s=30)
    loop.close()
    loop, it = forward_loop(n_steps)
    fwd.logits.zero_()
    t0 = time.perf_counter()
    loop.launch()
    assert loop.join(timeout_s=60)
    loop_ms = (time.perf_counter() - t0) * 1e3 / n_steps
    loop.close()
    got = fwd.logits[:R]
    logits_equal = bool(torch.equal(got, want))
    print(
        f"[3] smollm2-135m bf16 decode x4, bucket 8: host replay {replay_ms * 1e3:.1f} us/step, "
        f"in the loop {loop_ms * 1e3:.1f} us/step (+{(loop_ms - replay_ms) * 1e3:.1f}); "
        f"logits equal to replay: {logits_equal}"
    )
    results["forward_in_loop"] = {
        "model": "dummy:smollm2-135m bf16",
        "step": "4 decodes, bucket 8",
        "host_replay_us": replay_ms * 1e3,
        "loop_us": loop_ms * 1e3,
        "loop_minus_replay_us": (loop_ms - replay_ms) * 1e3,
        "minimal_loop_us": minimal_loop_ms * 1e3,
        "logits_equal_to_replay": logits_equal,
        "iterations": int(it.item()),
    }

    loop, it = forward_loop(2**62)
    loop.launch()
    time.sleep(0.3)
    t0 = time.perf_counter()
    loop.stop(timeout_s=1.0)
    busy_stop_ms = (time.perf_counter() - t0) * 1e3
    loop.close()
    reset_ring()
    print(
        f"[3] shutdown while busy (after {int(it.item())} steps): loop ended {busy_stop_ms:.2f} ms after the write"
    )
    results["shutdown_busy_ms"] = busy_stop_ms

    # 4. Wake-up latency from another process -----------------------------------------------------
    offset_ns, offset_err_ns = control.measure_clock_offset_ns()
    results["clock_offset_uncertainty_ns"] = offset_err_ns
    max_k = 4096
    stamps = torch.zeros(max_k + 1, dtype=torch.int64, device=dev)
    now = torch.zeros(1, dtype=torch.int64, device=dev)
    head = torch.zeros(1, dtype=torch.int64, device=dev)

    def idle_loop(backoff: Backoff) -> tuple[DeviceLoop, torch.Tensor]:
        iterations = torch.zeros(1, dtype=torch.int64, device=dev)
        keep = i32(1)

        def schedule() -> None:  # stand-in: stamp, then consume every published record
            head.copy_(words.req_head)
            control.stamp_globaltimer(now)
            stamps.index_copy_(0, torch.where(head != words.req_tail, head, max_k).clamp_(0, max_k), now)
            words.req_tail.copy_(head)
            iterations.add_(1)
            keep.copy_(words.shutdown == 0)

        loop = DeviceLoop(
            [schedule], num_active=i32(0), keep_running=keep, ring=words, control=control, backoff=backoff
        )
        return loop, iterations

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=front_end, args=(name, child), daemon=True)
    writer.start()
    caps = (0, 20_000, 100_000, 200_000)
    wake = {}
    idle_stop = {}
    k = region.load("req_head") + 1
    n_wakes = 80
    for cap in caps:
        backoff = Backoff(min(1_000, cap), cap)
        loop, iterations = idle_loop(backoff)
        loop.launch()
        parent.send((k, n_wakes, 0.002, 0.008))
        rows = parent.recv()
        stamps_host = stamps.cpu()  # another stream: the loop (non-blocking stream) keeps running
        time.sleep(0.02)
        t0 = time.perf_counter()
        loop.stop(timeout_s=1.0)
        idle_stop[cap] = (time.perf_counter() - t0) * 1e3
        assert int(iterations.item()) == n_wakes + 1, (int(iterations.item()), n_wakes)
        loop.close()
        reset_ring()
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
    results["wake"] = {str(c): v for c, v in wake.items()}
    results["shutdown_idle_ms"] = {str(c): v for c, v in idle_stop.items()}

    # 5. Idle power ----------------------------------------------------------------------------------
    def measure_power(seconds: float) -> dict:
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

    power = {"no loop": measure_power(args.power_seconds)}
    for label, backoff in (
        ("loop idle, cap 100 us", Backoff(1_000, 100_000)),
        ("loop idle, cap 20 us", Backoff(1_000, 20_000)),
        ("loop idle, no sleep (spin)", Backoff(0, 0)),
    ):
        loop, _ = idle_loop(backoff)
        loop.launch()
        power[label] = measure_power(args.power_seconds)
        loop.stop(timeout_s=1.0)
        loop.close()
        reset_ring()
    power["no loop (again)"] = measure_power(args.power_seconds)
    results["power"] = power

    print("\n| state | W (energy counter) | W (sampled) | SM MHz | util % | pstate |")
    print("|---|---|---|---|---|---|")
    for label, p in power.items():
        print(
            f"| {label} | {p['watts_energy']:.1f} | {p['watts_sampled_mean']:.1f} | "
            f"{p['sm_clock_mhz_median']:.0f} | {p['gpu_util_pct_median']:.0f} | P{p['pstate']} |"
        )
    print("\n| backoff cap | wake RTT p50 | p99 | max | one-way p50 | stop from idle |")
    print("|---|---|---|---|---|---|")
    for cap in caps:
        w = wake[cap]
        print(
            f"| {cap / 1e3:.0f} us | {w['round_trip_us']['p50']:.1f} us | {w['round_trip_us']['p99']:.1f} us | "
            f"{w['round_trip_us']['max']:.1f} us | {w['one_way_us']['p50']:.1f} us | {idle_stop[cap]:.2f} ms |"
        )
    print(
        f"\nloop control: {overhead[0]:.2f} us/iteration (0 switches), {overhead[2]:.2f} (2 empty switches); "
        f"forward in loop {loop_ms * 1e3:.1f} (minimal loop {minimal_loop_ms * 1e3:.1f}) vs replay "
        f"{replay_ms * 1e3:.1f} us/step; "
        f"busy shutdown {busy_stop_ms:.2f} ms; clock offset +-{offset_err_ns / 1e3:.1f} us"
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "device_loop_check.json").write_text(json.dumps(results, indent=2))
    mapped.close()
    transport.close()


if __name__ == "__main__":
    main()

"""Do SM partitions (green contexts, or MPS) hold for the loop's graphs? One device call, no model.

    python3 -m pip install -q --no-deps --no-build-isolation -e .
    PYTHONUNBUFFERED=1 python3 bench/sm_partition_probe.py --sm-counts 32 64 --out $OUT/sm_partition_probe.json
    bash bench/mps_probe.sh 25 75        # the same questions under MPS (--mps-client mode)

Green contexts, split through the driver (two disjoint partitions and the rest):
1. The driver's SM resource: what each requested count is rounded to.
2. Which SMs run a kernel (%smid of every program) launched in each partition: eagerly, from a
   graph captured on torch's default capture stream, from a graph captured on the partition's own
   stream, and from a DeviceLoop (the engine's WHILE graph) built inside the partition.
   Which graphs instantiate there at all: a child graph node, and a WHILE node whose body holds the
   partition's kernels, for each choice of context of the node and its handle.
3. A WHILE loop of a fixed compute-bound kernel in partition A, alone and while a loop in partition
   B runs; and the same two loops without partitions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.device_loop_check import Rig  # noqa: E402
from blink_appliance.engine.loop.graph import DeviceLoop  # noqa: E402

# -- green contexts through the driver (what the loop would need; see the finding above) -----------
_active = threading.local()


def capture_stream() -> object | None:
    """The stream graphs must be captured on for their kernels to stay in the active partition: a
    graph's kernels run in the context of the stream they were captured on."""
    return getattr(_active, "capture", None)


def driver():
    """cuda-bindings' driver module, or a clear error where it is missing (CPU-only installs)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("SM partitions need cuda-bindings (pip install 'blink-appliance[gpu]')") from exc
    return cu


def check_driver(result: tuple) -> tuple:
    """Unpack a driver call's (CUresult, *values); raise with the driver's name for the error."""
    cu = driver()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {name.decode()}: {text.decode()}")
    return tuple(values)


@dataclass(frozen=True)
class SmSplit:
    """How the driver split a device: SMs per requested group (rounded up by it) and the rest."""

    device_sms: int
    granted: tuple[int, ...]  # one per requested count, in order
    rest: int


@dataclass
class SmPartition:
    """One model's share of the GPU; `activate()` makes it current on the calling thread."""

    model_index: int
    device_index: int
    sm_count: int | None  # SMs granted; None: no partition (the whole GPU, primary context)
    requested: int | None = None  # the profile's sm_count (None: shares the rest)
    _green: object | None = field(default=None, repr=False)
    _context: object | None = field(default=None, repr=False)
    _stream: object | None = field(default=None, repr=False)
    _capture: object | None = field(default=None, repr=False)

    def describe(self) -> str:
        if self.sm_count is None:
            return f"models[{self.model_index}]: no SM partition (the whole GPU, shared)"
        ask = f"sm_count {self.requested}" if self.requested is not None else "the rest"
        return f"models[{self.model_index}]: {self.sm_count} SMs ({ask}) in a green context"

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """This model's green context current on this thread, its stream torch's current stream."""
        if self._context is None:
            yield
            return
        import torch

        cu = driver()
        # torch's set_device is a no-op for the current device; called first so that nothing
        # inside switches the thread back to the primary context with cudaSetDevice.
        torch.cuda.set_device(self.device_index)
        check_driver(cu.cuCtxPushCurrent(self._context))
        outer, _active.capture = capture_stream(), self._capture
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            _active.capture = outer
            check_driver(cu.cuCtxPopCurrent())

    def close(self) -> None:
        if self._green is not None:
            cu = driver()
            check_driver(cu.cuGreenCtxDestroy(self._green))
            self._green = self._context = self._stream = self._capture = None


def split_sms(device_index: int, counts: Sequence[int]) -> tuple[SmSplit, list[object], object]:
    """Split the device's SMs into len(counts) disjoint groups and the remainder (driver objects)."""
    cu = driver()
    (dev,) = check_driver(cu.cuDeviceGet(device_index))
    (whole,) = check_driver(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, granted, rest = [], [], whole
    for count in counts:
        result, n, remaining = check_driver(cu.cuDevSmResourceSplitByCount(1, rest, 0, count))
        if n != 1:
            raise RuntimeError(
                f"sm_count {count}: the driver could not carve it from the {rest.sm.smCount} SMs left"
            )
        group = result[0] if isinstance(result, (list, tuple)) else result
        groups.append(group)
        granted.append(int(group.sm.smCount))
        rest = remaining
    split = SmSplit(int(whole.sm.smCount), tuple(granted), int(rest.sm.smCount))
    return split, groups, rest


def _green_context(dev_index: int, resource: object) -> tuple[object, object, object, object]:
    """A green context over `resource`, its CUcontext and two non-blocking streams of it (torch's):
    one to run on, one to capture graphs on."""
    import torch

    cu = driver()
    (dev,) = check_driver(cu.cuDeviceGet(dev_index))
    (desc,) = check_driver(cu.cuDevResourceGenerateDesc([resource], 1))
    flags = cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
    (green,) = check_driver(cu.cuGreenCtxCreate(desc, dev, flags))
    (context,) = check_driver(cu.cuCtxFromGreenCtx(green))
    non_blocking = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    streams = [check_driver(cu.cuGreenCtxStreamCreate(green, non_blocking, 0))[0] for _ in range(2)]
    device = torch.device("cuda", dev_index)
    run, capture = (torch.cuda.ExternalStream(int(s), device=device) for s in streams)
    return green, context, run, capture


@triton.jit
def smid_hits(hits_ptr, work: tl.constexpr):
    """Each program adds one hit for the SM it ran on, after `work` dependent FMAs (to be busy)."""
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    x = tl.program_id(0).to(tl.float32)
    for _ in range(work):
        x = x * 1.0000001 + 0.5
    tl.atomic_add(hits_ptr + smid, 1 + (x < -1.0).to(tl.int32))


PROGRAMS = 1024


def used_sms(hits: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(hits).flatten().tolist()]


def loop_of(rig: Rig, hits: torch.Tensor, n: int, work: int) -> DeviceLoop:
    it = torch.zeros(1, dtype=torch.int64, device=rig.dev)
    keep = rig.i32(1)

    def body() -> None:
        smid_hits[(PROGRAMS,)](hits, work)
        it.add_(1)
        keep.copy_(it < n)

    return DeviceLoop([body], num_active=rig.i32(1), keep_running=keep, ring=rig.words, control=rig.control)


def with_own_control(rig: Rig) -> Rig:
    """The rig with a LoopControl loaded in the current (green) context, as the engine builds it."""
    from blink_appliance.engine.loop.control import LoopControl

    return dataclasses.replace(rig, control=LoopControl(rig.dev))


def where_it_runs(rig: Rig, part: SmPartition) -> dict[str, list[int] | str]:
    out: dict[str, list[int] | str] = {}
    with part.activate():
        rig = with_own_control(rig)
        hits = torch.zeros(1024, dtype=torch.int32, device=rig.dev)
        smid_hits[(PROGRAMS,)](hits, 16)
        torch.cuda.current_stream().synchronize()
        out["eager"] = used_sms(hits)
        try:
            hits.zero_()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # torch's default capture stream (the primary context)
                smid_hits[(PROGRAMS,)](hits, 16)
            g.replay()
            torch.cuda.current_stream().synchronize()
            out["graph_default_capture_stream"] = used_sms(hits)
        except Exception as e:
            out["graph_default_capture_stream"] = f"error: {e}"
        try:
            hits.zero_()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=capture_stream()):  # as the engine captures
                smid_hits[(PROGRAMS,)](hits, 16)
            g.replay()
            torch.cuda.current_stream().synchronize()
            out["graph_partition_capture_stream"] = used_sms(hits)
        except Exception as e:
            out["graph_partition_capture_stream"] = f"error: {e}"
        try:
            hits.zero_()
            loop = loop_of(rig, hits, 20, 16)
            loop.launch()
            assert loop.join(timeout_s=30)
            loop.close()
            out["while_loop"] = used_sms(hits)
        except Exception as e:
            import traceback

            traceback.print_exc()
            out["while_loop"] = f"error: {e}"
    return out


def instantiate_checks(rig: Rig, part: SmPartition) -> dict[str, str]:
    """Which graph shapes instantiate in the partition, their kernels captured on its stream: a child
    graph node, and a WHILE node (driver API) for each choice of context of the node and its handle."""
    from blink_appliance.engine.loop.mapped_region import check, cudart

    rt, cu = cudart(), driver()
    out = {}
    with part.activate():
        rig = with_own_control(rig)
        x = torch.zeros(4, device=rig.dev)

        def captured(fn) -> int:
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, stream=capture_stream()):
                fn()
            captured.keep.append(g)
            return g.raw_cuda_graph()

        captured.keep = []

        def plain() -> None:
            x.add_(1)

        (dev,) = check_driver(cu.cuDeviceGet(0))
        (primary,) = check_driver(cu.cuDevicePrimaryCtxRetain(dev))
        (green,) = check_driver(cu.cuCtxGetCurrent())

        def while_with(node_ctx, handle_ctx) -> str:
            try:
                (outer,) = check(rt.cudaGraphCreate(0))
                graph = cu.CUgraph(init_value=int(outer))
                (handle,) = check_driver(cu.cuGraphConditionalHandleCreate(graph, handle_ctx, 1, 1))
                params = cu.CUgraphNodeParams()
                params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
                params.conditional.handle = handle
                params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
                params.conditional.size = 1
                params.conditional.ctx = node_ctx
                check_driver(cu.cuGraphAddNode(graph, None, None, 0, params))
                body = rt.cudaGraph_t(init_value=int(params.conditional.phGraph_out[0]))
                DeviceLoop._add_child(body, None, captured(plain))
                check(rt.cudaGraphInstantiate(outer, 0))
                return "ok"
            except Exception as e:
                return f"error: {e}"

        out["while_ctx_primary_primary"] = while_with(primary, primary)
        out["while_ctx_green_primary"] = while_with(green, primary)
        out["while_ctx_primary_green"] = while_with(primary, green)
        out["while_ctx_none_none"] = while_with(cu.CUcontext(0), cu.CUcontext(0))
        try:
            (outer,) = check(rt.cudaGraphCreate(0))
            check(rt.cudaGraphAddChildGraphNode(outer, None, 0, rt.cudaGraph_t(init_value=captured(plain))))
            check(rt.cudaGraphInstantiate(outer, 0))
            out["child_graph"] = "ok"
        except Exception as e:
            out["child_graph"] = f"error: {e}"
        print(f"[diag] partition of {part.sm_count} SMs: {out}")
    return out


def timed_loops(rig: Rig, parts: list[SmPartition], concurrent: bool, n: int, work: int) -> list[float]:
    """Seconds for each partition's loop of n compute-bound iterations (both at once if concurrent)."""
    loops = []
    for part in parts:
        with part.activate():
            rig = with_own_control(rig)
            hits = torch.zeros(1024, dtype=torch.int32, device=rig.dev)
            loops.append(loop_of(rig, hits, n, work))
    took = [0.0] * len(parts)

    def run(k: int) -> None:
        with parts[k].activate():
            t0 = time.perf_counter()
            loops[k].launch()
            assert loops[k].join(timeout_s=120)
            took[k] = time.perf_counter() - t0

    if concurrent:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(parts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        run(0)
    for part, loop in zip(parts, loops, strict=True):
        with part.activate():
            loop.close()
    return took


def mps_client(args: argparse.Namespace) -> None:
    """Under MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set by the caller): where the kernels, a graph
    and a WHILE loop run, then one timed loop of compute-bound iterations started at --start-at."""
    import os

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rig = Rig.create(dev)
    warm = torch.zeros(1024, dtype=torch.int32, device=dev)
    smid_hits[(PROGRAMS,)](warm, 16)
    smid_hits[(PROGRAMS,)](warm, args.work)
    torch.cuda.synchronize()
    where = where_it_runs(rig, SmPartition(0, 0, None))
    pct = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    counts = {k: len(v) if isinstance(v, list) else v for k, v in where.items()}
    print(f"[mps {args.mps_client}] active thread percentage {pct}: {counts}", flush=True)
    while time.time() < args.start_at:
        time.sleep(0.001)
    took = timed_loops(rig, [SmPartition(0, 0, None)], False, args.iters, args.work)[0]
    print(
        f"[mps {args.mps_client}] loop of {args.iters} compute-bound iterations: {took * 1e3:.1f} ms",
        flush=True,
    )
    rig.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sm-counts", type=int, nargs="+", default=[32])
    parser.add_argument("--work", type=int, default=4000)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--mps-client", default=None, help="label: run as an MPS client and print where it runs"
    )
    parser.add_argument("--start-at", type=float, default=0.0, help="time.time() to start the timed loop at")
    args = parser.parse_args()
    if args.mps_client is not None:
        mps_client(args)
        return
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    rig = Rig.create(dev)
    warm = torch.zeros(1024, dtype=torch.int32, device=dev)
    smid_hits[(PROGRAMS,)](warm, 16)
    smid_hits[(PROGRAMS,)](warm, args.work)
    torch.cuda.synchronize()
    result: dict = {
        "device": torch.cuda.get_device_name(dev),
        "sm_count": torch.cuda.get_device_properties(dev).multi_processor_count,
    }
    cu = driver()
    for name in (
        "cuDevSmResourceSplitByCount",
        "cuDevResourceGenerateDesc",
        "cuGreenCtxCreate",
        "cuGreenCtxStreamCreate",
    ):
        print(f"[0] {name}: {(getattr(cu, name).__doc__ or '')[:300]!r}")
    try:
        for asked in ([c] for c in args.sm_counts):
            split, groups, rest = split_sms(0, asked)
            print(f"[1] asked {asked}: granted {split.granted}, rest {split.rest} of {split.device_sms} SMs")
            parts = []
            for k, res in enumerate([*groups, rest]):
                green, ctx, stream, capture = _green_context(0, res)
                parts.append(SmPartition(k, 0, int(res.sm.smCount), None, green, ctx, stream, capture))
            result[f"instantiate_{asked[0]}"] = [instantiate_checks(rig, p) for p in parts]
            result["instantiate_primary"] = instantiate_checks(rig, SmPartition(0, 0, None))
            where = [where_it_runs(rig, p) for p in parts]
            for p, w in zip(parts, where, strict=True):
                print(
                    f"[2] partition of {p.sm_count} SMs: "
                    + ", ".join(
                        f"{k} on {len(v)} SMs" if isinstance(v, list) else f"{k}: {v}" for k, v in w.items()
                    )
                )
            disjoint = {
                k: not set(where[0][k]) & set(where[1][k])
                for k in where[0]
                if isinstance(where[0][k], list) and isinstance(where[1][k], list)
            }
            print(f"[2] partitions disjoint: {disjoint}")
            whole = [SmPartition(0, 0, None), SmPartition(1, 0, None)]
            rows = {}
            for label, ps in (("partitioned", parts), ("unpartitioned", whole)):
                try:
                    alone = timed_loops(rig, ps, False, args.iters, args.work)[0]
                except Exception as e:
                    print(f"[3] {label}: error {e}")
                    rows[label] = f"error: {e}"
                    continue
                alone = timed_loops(rig, ps, False, args.iters, args.work)[0]
                both = timed_loops(rig, ps, True, args.iters, args.work)
                rows[label] = {
                    "a_alone_s": alone,
                    "a_with_b_s": both[0],
                    "b_with_a_s": both[1],
                    "ratio": both[0] / alone,
                }
                print(
                    f"[3] {label}: A alone {alone * 1e3:.1f} ms, A with B {both[0] * 1e3:.1f} ms ({both[0] / alone:.2f}x), B {both[1] * 1e3:.1f} ms"
                )
            result[f"asked_{asked[0]}"] = {
                "granted": split.granted,
                "rest": split.rest,
                "where": where,
                "disjoint": disjoint,
                "isolation": rows,
            }
            for p in parts:
                p.close()
    finally:
        rig.close()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Can the GPU loop's graphs carry a tensor-parallel all-reduce, and at what cost? (issue 27)

On a host with 2 GPUs (`nvidia-h100-x2`; NCCL's defaults, NVLink multicast off):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 300 python3 bench/tp_collectives.py --out $OUT/tp_collectives.json

Two ranks, a process and a GPU each. Per all-reduce method and size (bf16 elements), each variant
checks the reduced values:
- "eager": the all-reduce called from Python, µs per call;
- "plain": captured --reps times into one torch CUDA graph, replayed: µs per all-reduce;
- "while": the capture as a child graph in the body of a WHILE node, as the loop runs its body,
  with a device counter that ends it: µs per iteration, less an empty body's ("while_empty");
- "switch": inside a SWITCH branch in that WHILE body, where the loop puts its forward graphs.
A CUDA error at build or instantiation (a node type a conditional body does not allow) is recorded
as the variant's result, with the stage it failed at and the node types of the collective's capture.
Methods: "nccl" (torch.distributed, NCCL), "nccl_direct" (cupy's NCCL on the capturing stream:
fp32, as cupy names no bf16) and "symm_mem" (torch's symmetric-memory one-shot all-reduce: peer
loads over NVLink in a plain kernel).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from blink_appliance.engine.loop.control import LoopControl  # noqa: E402
from blink_appliance.engine.loop.graph import DeviceLoop  # noqa: E402
from blink_appliance.engine.loop.mapped_region import check, cudart  # noqa: E402

WORLD = 2
ASSIGN_DEFAULT = 1  # cudaGraphCondAssignDefault


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Method:
    """One way to all-reduce a bf16 vector in place, capturable."""

    def __init__(self, name: str, n: int, device: torch.device) -> None:
        self.name = name
        if name == "nccl":
            self.x = torch.empty(n, dtype=torch.bfloat16, device=device)
            self.reduce: Callable[[], None] = lambda: dist.all_reduce(self.x)
        elif name == "nccl_direct":  # NCCL on the capturing stream itself, without torch's side stream
            from cupy.cuda import nccl

            uid = [nccl.get_unique_id() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(uid, src=0)
            self.comm = nccl.NcclCommunicator(WORLD, uid[0], dist.get_rank())
            self.x = torch.empty(n, dtype=torch.float32, device=device)

            def reduce() -> None:
                stream = torch.cuda.current_stream(device).cuda_stream
                p = self.x.data_ptr()
                self.comm.allReduce(p, p, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream)

            self.reduce = reduce
        else:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group)
            self.x = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(self.x, group)

            def reduce() -> None:
                self.x.copy_(torch.ops.symm_mem.one_shot_all_reduce(self.x, "sum", group))

            self.reduce = reduce


def timed(stream: torch.cuda.Stream, launch: Callable[[], None]) -> float:
    """Seconds the work `launch` puts on `stream` takes on the device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record()
        launch()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class WhileGraph:
    """WHILE(counter > 0) { [switch: SWITCH(0) {] reduce [}] ; x *= 0.5; counter -= 1 } as the loop builds it."""

    def __init__(self, x: torch.Tensor, control: LoopControl) -> None:
        self.x, self.control, self.captures, self.pool = x, control, [], torch.cuda.graph_pool_handle()
        self.counter = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.keep = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.zero = torch.zeros(1, dtype=torch.int32, device=x.device)  # set_switch reads it every iteration
        self.stage, self.graph, self.exec = "create", None, None

    def build(self, method: Method | None, switch: bool) -> None:
        """The graph around `method`'s all-reduce (None: an empty body); `stage` says how far it got."""
        rt, x, control = cudart(), self.x, self.control
        (self.graph,) = check(rt.cudaGraphCreate(0))
        (wh,) = check(rt.cudaGraphConditionalHandleCreate(self.graph, 1, ASSIGN_DEFAULT))
        _, (body,) = DeviceLoop._add_conditional(
            self.graph, None, wh, rt.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile, 1
        )
        last = None
        if method is not None and switch:
            (sh,) = check(rt.cudaGraphConditionalHandleCreate(body, 1, ASSIGN_DEFAULT))
            last = DeviceLoop._add_child(
                body, None, self.capture(lambda: control.set_switch(int(sh), self.zero))
            )
            last, (branch,) = DeviceLoop._add_conditional(
                body, last, sh, rt.cudaGraphConditionalNodeType.cudaGraphCondTypeSwitch, 1
            )
            self.stage = "add the collective's capture to the SWITCH branch"
            DeviceLoop._add_child(branch, None, self.capture(method.reduce))
        elif method is not None:
            self.stage = "add the collective's capture to the WHILE body"
            last = DeviceLoop._add_child(body, None, self.capture(method.reduce))

        def tail() -> None:
            x.mul_(0.5)
            self.counter.sub_(1)
            torch.clamp(self.counter, 0, 1, out=self.keep)
            control.set_while(int(wh), self.keep)

        self.stage = "add the tail"
        DeviceLoop._add_child(body, last, self.capture(tail))
        self.stage = "instantiate"
        (self.exec,) = check(rt.cudaGraphInstantiate(self.graph, 0))

    def capture(self, launch: Callable[[], None]) -> int:
        self.stage += " (capture)"
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, pool=self.pool):
            launch()
        self.captures.append(g)
        return g.raw_cuda_graph()

    def run(self, iterations: int, stream: torch.cuda.Stream) -> float:
        self.counter.fill_(iterations)
        torch.cuda.synchronize()
        return timed(stream, lambda: check(cudart().cudaGraphLaunch(self.exec, stream.cuda_stream)))

    def close(self) -> None:
        rt = cudart()
        if self.exec is not None:
            check(rt.cudaGraphExecDestroy(self.exec))
        if self.graph is not None:
            check(rt.cudaGraphDestroy(self.graph))


def node_types(launch: Callable[[], None]) -> dict[str, int]:
    """The node types of `launch` captured alone: what a conditional body would have to hold."""
    rt = cudart()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        launch()
    raw = rt.cudaGraph_t(init_value=g.raw_cuda_graph())
    _, count = check(rt.cudaGraphGetNodes(raw, 0))
    nodes, _ = check(rt.cudaGraphGetNodes(raw, count))
    types: dict[str, int] = {}
    for node in nodes[:count]:
        (kind,) = check(rt.cudaGraphNodeGetType(node))
        types[kind.name] = types.get(kind.name, 0) + 1
    return types


def agreed(ok: bool) -> bool:
    """Every rank's ok: a rank alone must never launch a collective graph."""
    flags: list[Any] = [None] * WORLD
    dist.all_gather_object(flags, ok)
    return all(flags)


def variant(name: str, run: Callable[[], float], x: torch.Tensor, rank: int, per: int) -> dict[str, Any]:
    """Reset x to rank + 1, run, and check: an all-reduce then x *= 0.5 keeps 1.5 (2 ranks)."""
    x.fill_(rank + 1)
    seconds = run()
    good = bool(torch.all(x == 1.5).item()) if name != "while_empty" else True
    return {"us": round(seconds / per * 1e6, 2), "values_ok": good}


def measure(
    method_name: str, n: int, args: argparse.Namespace, rank: int, control: LoopControl
) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    out: dict[str, Any] = {"method": method_name, "elements": n}
    try:
        method = Method(method_name, n, device)
        ok = True
    except Exception as e:  # noqa: BLE001 - recorded: the method is not available here
        out["error"], ok = f"{type(e).__name__}: {e}"[:300], False
    if not agreed(ok):
        out.setdefault("error", "another rank could not set it up")
        return out
    x, stream, iters = method.x, torch.cuda.Stream(device), args.iterations

    def eager() -> float:
        def calls() -> None:
            for _ in range(iters):
                method.reduce()
                x.mul_(0.5)

        return timed(stream, calls)

    for _ in range(3):  # warm-up: communicators, kernels
        x.fill_(rank + 1)
        method.reduce()
    torch.cuda.synchronize()
    out["eager"] = variant("eager", eager, x, rank, iters)
    try:
        out["capture_node_types"] = node_types(method.reduce)
    except Exception as e:  # noqa: BLE001 - a listing, not the measurement
        out["capture_node_types"] = f"{type(e).__name__}: {e}"[:200]

    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        for _ in range(args.reps):
            method.reduce()
            x.mul_(0.5)
    replays = max(1, iters // args.reps)
    out["plain"] = variant(
        "plain",
        lambda: timed(stream, lambda: [plain.replay() for _ in range(replays)]),
        x,
        rank,
        replays * args.reps,
    )
    for name, m, switch in (("while_empty", None, False), ("while", method, False), ("switch", method, True)):
        graph = WhileGraph(x, control)
        try:
            graph.build(m, switch)
            built = True
        except Exception as e:  # noqa: BLE001 - the finding: this body cannot hold the collective
            out[name], built = {"error": f"{type(e).__name__}: {e}"[:300], "stage": graph.stage}, False
        if agreed(built):
            out[name] = variant(name, lambda g=graph: g.run(iters, stream), x, rank, iters)
        else:
            out.setdefault(name, {"error": "another rank could not build it"})
        graph.close()
    if "us" in out.get("while", {}) and "us" in out.get("while_empty", {}):
        out["while_net_us"] = round(out["while"]["us"] - out["while_empty"]["us"], 2)
    return out


def rank_main(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=device)
    control = LoopControl(device)
    results = []
    for method_name in args.methods:
        for n in args.elements:
            r = measure(method_name, n, args, rank, control)
            r["rank"] = rank
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, r)
            if rank == 0:
                results.append(gathered)
                print(json.dumps(gathered[0]), flush=True)
    if rank == 0:
        from torch.cuda import nccl

        report = {
            "gpu": torch.cuda.get_device_name(device),
            "gpus": WORLD,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, v)) if isinstance(v := nccl.version(), tuple) else str(v),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--methods", nargs="+", default=["nccl", "symm_mem"], choices=["nccl", "nccl_direct", "symm_mem"]
    )
    # 8B's hidden size at 1, 8 and 256 tokens, and 1B's at 1
    ap.add_argument("--elements", type=int, nargs="+", default=[4096, 8 * 4096, 256 * 4096, 2048])
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=50, help="all-reduces per plain graph")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    torch.multiprocessing.spawn(rank_main, args=(free_port(), args), nprocs=WORLD)


if __name__ == "__main__":
    main()

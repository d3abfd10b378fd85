"""The outer CUDA graph of the GPU loop: one WHILE node whose body is the whole engine iteration.

    graph:  WHILE(keep_running) {
              [captured: launches ... -> set_switches(A, B)]
              SWITCH A { branch 0 | branch 1 | ... }           value >= branches: none runs
              SWITCH B { ... }
              [captured: launches ... -> wait_and_set_while(keep_running)]
            }

The body is given as a list of segments: a `Launch` is a Python callable that launches device work
on torch's current stream (Triton, torch ops, the control kernels); consecutive launches are
captured together (torch.cuda.graph, keep_graph=True) into one child graph. A `Switch` reads its
value from an int32 [1] device tensor. Switches that follow one another get their values from one
kernel at the end of the capture before the first of them, so a switch's branches must not change
the value of the switches after it (each dependent launch costs the step 1.5-3 us). The last capture
ends with the kernel that hands keep_running to the WHILE node and, with a ring, first waits there
for work: the idle poll of the next iteration, in the same launch. Branches are
sequences of parts: a Launch (captured here) or a `RawGraph` captured elsewhere (e.g.
ForwardGraphs.raw_cuda_graph(T)), run in order. Every capture here shares one memory pool.

The host launches the graph once (`launch`) on a stream of its own and then only watches it:
`running`, `join`, and `stop`, which writes the ring's shutdown word through the mapped region and
waits for the body to drop keep_running. While the loop runs, nothing in this process may
synchronize the whole device (torch.cuda.synchronize() would wait for the loop to end); stream-level
work on other streams is fine (the loop's stream is non-blocking).

Launches must be warmed up by their owner before capture (Triton compilation, cuBLAS handles):
capture records work, it does not run it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blink_appliance.engine.loop.control import Backoff, LoopControl
from blink_appliance.engine.loop.mapped_region import RingWords, check, cudart

Launch = Callable[[], None]

# cudaGraphCondAssignDefault: a handle takes its default value at the start of every execution of
# the graph it belongs to (for a SWITCH handle, every iteration of the body).
_ASSIGN_DEFAULT = 1


@dataclass(frozen=True)
class RawGraph:
    """A cudaGraph_t captured elsewhere; its owner keeps it (and its memory pool) alive."""

    graph: int


Part = Launch | RawGraph


@dataclass
class Switch:
    """A SWITCH node: runs branches[value[0]]; a value >= len(branches) or < 0 runs none."""

    name: str
    value: torch.Tensor  # int32 [1] on the loop's device, written by an earlier launch
    branches: Sequence[Sequence[Part]]

    def __post_init__(self) -> None:
        if not self.branches:
            raise ValueError(f"switch {self.name!r} has no branches")
        for i, branch in enumerate(self.branches):
            if not branch:
                raise ValueError(f"switch {self.name!r}: branch {i} is empty")
            for part in branch:
                if not (isinstance(part, RawGraph) or callable(part)):
                    raise TypeError(
                        f"switch {self.name!r}: branch {i} holds {part!r}, not a launch or RawGraph"
                    )
        if self.value.dtype != torch.int32 or self.value.numel() != 1:
            raise ValueError(f"switch {self.name!r}: value must be an int32 tensor of one element")


Segment = Launch | Switch


# -- the plan: which launches are captured together, where the conditional setters go --------------
@dataclass(frozen=True)
class SetSwitches:
    """Plan marker: the kernel that hands the values of switches `indices` (a run of consecutive
    switches) to their SWITCH nodes."""

    indices: tuple[int, ...]


@dataclass(frozen=True)
class SetWhile:
    """Plan marker: the kernel that hands keep_running to the WHILE node (after the idle poll of the
    next iteration, for a loop with a ring)."""


@dataclass
class CaptureStep:
    launches: list[Launch | SetSwitches | SetWhile] = field(default_factory=list)


@dataclass(frozen=True)
class SwitchStep:
    index: int  # into the plan's switches


@dataclass
class BodyPlan:
    steps: list[CaptureStep | SwitchStep]
    switches: list[Switch]


def plan_body(segments: Sequence[Segment]) -> BodyPlan:
    """Group the body into captured child graphs and SWITCH nodes, in order.

    A run of consecutive switches gets one setter, at the end of the capture right before the run (a
    capture of the setter alone when the run opens the body); set_while ends the last capture. So the
    body is always capture, (switch+, capture)*.
    """
    for segment in segments:
        if not (isinstance(segment, Switch) or callable(segment)):
            raise TypeError(f"a loop body segment must be a launch or a Switch, not {segment!r}")
    steps: list[CaptureStep | SwitchStep] = []
    switches: list[Switch] = []
    pending = CaptureStep()
    i = 0
    while i < len(segments):
        segment = segments[i]
        if not isinstance(segment, Switch):
            pending.launches.append(segment)
            i += 1
            continue
        run = []
        while i < len(segments) and isinstance(segments[i], Switch):
            run.append(len(switches))
            switches.append(segments[i])
            i += 1
        pending.launches.append(SetSwitches(tuple(run)))
        steps += [pending, *(SwitchStep(k) for k in run)]
        pending = CaptureStep()
    pending.launches.append(SetWhile())
    steps.append(pending)
    return BodyPlan(steps, switches)


class BucketGraphs(Protocol):
    """What the loop uses of ForwardGraphs: the captured bucket sizes and their cudaGraph_t."""

    buckets: tuple[int, ...]

    def raw_cuda_graph(self, num_tokens: int) -> int: ...


def engine_body(
    *,
    bucket_index: torch.Tensor,
    sampler_index: torch.Tensor,
    forward: BucketGraphs,
    schedule: Launch,
    samplers: Sequence[Launch],
    commit: Launch,
) -> list[Segment]:
    """The engine iteration (docs/device_loop.md): schedule -> SWITCH bucket -> SWITCH sampler -> commit.

    bucket_index / sampler_index are DeviceState's: bucket_index = len(forward.buckets) runs no
    forward; sampler_index i runs samplers[i] (DeviceSampler.variants(), kernels/sampling.py SAMPLER_*),
    and a value past them runs none.
    """
    return [
        schedule,
        Switch("bucket", bucket_index, [[RawGraph(forward.raw_cuda_graph(T))] for T in forward.buckets]),
        Switch("sampler", sampler_index, [[sample] for sample in samplers]),
        commit,
    ]


def poll_until_ended(running: Callable[[], bool], timeout_s: float | None, poll_s: float) -> bool:
    """Poll `running` until it is False (True) or timeout_s has passed (False)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while running():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class DeviceLoop:
    """The engine loop as one CUDA graph, built (captured) at construction, launched once."""

    def __init__(
        self,
        body: Sequence[Segment],
        *,
        num_active: torch.Tensor,
        keep_running: torch.Tensor,
        ring: RingWords | None,
        control: LoopControl,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.device = control.device
        for name, t in (("num_active", num_active), ("keep_running", keep_running)):
            if t.dtype != torch.int32 or t.numel() != 1 or t.device != self.device:
                raise ValueError(f"{name} must be an int32 tensor of one element on {self.device}")
        self.control = control
        self.ring = ring
        self.keep_running = keep_running
        self.num_active = num_active
        self.backoff = backoff

        self.plan = plan_body(list(body))
        # The setters' device arrays (LoopControl.switch_table), built before any capture reads them.
        self._switch_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._captures: list[torch.cuda.CUDAGraph] = []  # their graphs and pool back our clones
        self._pool = torch.cuda.graph_pool_handle()
        self._graph = None
        self._exec = None
        self._stream = None
        self._launched = False
        try:
            self._build()
        except BaseException:
            self._destroy()
            raise

    # -- construction ---------------------------------------------------------------------------
    def _build(self) -> None:
        rt = cudart()
        with torch.cuda.device(self.device):
            (self._graph,) = check(rt.cudaGraphCreate(0))
            (while_handle,) = check(rt.cudaGraphConditionalHandleCreate(self._graph, 1, _ASSIGN_DEFAULT))
            _, (body,) = self._add_conditional(
                self._graph, None, while_handle, rt.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile, 1
            )
            # SWITCH handles belong to the body graph, where their nodes are (fact 2); the default
            # (no branch) applies whenever a setter did not run.
            handles = [
                check(rt.cudaGraphConditionalHandleCreate(body, len(s.branches), _ASSIGN_DEFAULT))[0]
                for s in self.plan.switches
            ]
            self.while_handle = int(while_handle)
            self.switch_handles = [int(h) for h in handles]
            for step in self.plan.steps:
                for launch in step.launches if isinstance(step, CaptureStep) else ():
                    if isinstance(launch, SetSwitches):
                        self._switch_tables[launch.indices] = self.control.switch_table(
                            [self.switch_handles[i] for i in launch.indices],
                            [self.plan.switches[i].value for i in launch.indices],
                        )

            last = None
            for step in self.plan.steps:
                if isinstance(step, CaptureStep):
                    last = self._add_child(body, last, self._capture(step.launches))
                else:
                    switch = self.plan.switches[step.index]
                    last, branch_graphs = self._add_conditional(
                        body,
                        last,
                        handles[step.index],
                        rt.cudaGraphConditionalNodeType.cudaGraphCondTypeSwitch,
                        len(switch.branches),
                    )
                    for branch, graph in zip(switch.branches, branch_graphs, strict=True):
                        prev = None
                        for part in branch:
                            raw = part.graph if isinstance(part, RawGraph) else self._capture([part])
                            prev = self._add_child(graph, prev, raw)

            (self._exec,) = check(rt.cudaGraphInstantiate(self._graph, 0))
            (self._stream,) = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))

    def _capture(self, launches: Sequence[Launch | SetSwitches | SetWhile]) -> int:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        # torch's default capture stream lives on the device that first captured in the process, so
        # a loop on another GPU (tensor parallelism) names a stream of its own device.
        with torch.cuda.graph(graph, pool=self._pool, stream=torch.cuda.Stream(self.device)):
            for launch in launches:
                if isinstance(launch, SetSwitches):
                    self.control.set_switches(self._switch_tables[launch.indices])
                elif isinstance(launch, SetWhile) and self.ring is not None:
                    self.control.wait_and_set_while(
                        self.while_handle, self.keep_running, self.num_active, self.ring, self.backoff
                    )
                elif isinstance(launch, SetWhile):  # a follower: its first launch waits (plan_link)
                    self.control.set_while(self.while_handle, self.keep_running)
                else:
                    launch()
        self._captures.append(graph)
        return graph.raw_cuda_graph()

    @staticmethod
    def _add_child(graph, after, child: int):
        rt = cudart()
        deps = [after] if after is not None else None
        (node,) = check(
            rt.cudaGraphAddChildGraphNode(graph, deps, len(deps or ()), rt.cudaGraph_t(init_value=child))
        )
        return node

    @staticmethod
    def _add_conditional(graph, after, handle, kind, size: int):
        rt = cudart()
        params = rt.cudaGraphNodeParams()
        params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        params.conditional.handle = handle
        params.conditional.type = kind
        params.conditional.size = size
        deps = [after] if after is not None else None
        (node,) = check(rt.cudaGraphAddNode(graph, deps, None, len(deps or ()), params))
        out = params.conditional.phGraph_out  # CUDA-owned body graphs, one per branch
        bodies = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(bodies) != size:
            raise RuntimeError(f"conditional node returned {len(bodies)} body graphs, expected {size}")
        return node, bodies

    # -- running --------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the loop. Work already queued on torch's current stream (state set-up) runs first."""
        if self._launched:
            raise RuntimeError("the device loop was already launched (it runs once)")
        torch.cuda.current_stream(self.device).synchronize()
        rt = cudart()
        check(rt.cudaGraphLaunch(self._exec, self._stream))
        self._launched = True

    def running(self) -> bool:
        if not self._launched:
            return False
        rt = cudart()
        (err,) = rt.cudaStreamQuery(self._stream)
        if err == rt.cudaError_t.cudaErrorNotReady:
            return True
        check((err,))
        return False

    def join(self, timeout_s: float | None = None, poll_s: float = 0.0002) -> bool:
        """Wait (polling, so a timeout is possible) for the loop to end; True if it ended."""
        return poll_until_ended(self.running, timeout_s, poll_s)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Ask the loop to stop through the ring's shutdown word and wait for it to end."""
        if self.ring is None:
            raise RuntimeError("a follower loop has no ring: it stops when its leader does")
        self.ring.request_shutdown()
        if not self.join(timeout_s):
            raise TimeoutError(f"the device loop did not stop within {timeout_s} s of shutdown")

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the graph and its stream. The loop must have ended (stop() or its own condition)."""
        if self.running():
            raise RuntimeError("close() on a running device loop: stop() it first")
        self._destroy()

    def _destroy(self) -> None:
        rt = cudart()
        if self._exec is not None:
            check(rt.cudaGraphExecDestroy(self._exec))
            self._exec = None
        if self._graph is not None:
            check(rt.cudaGraphDestroy(self._graph))
            self._graph = None
        if self._stream is not None:
            check(rt.cudaStreamDestroy(self._stream))
            self._stream = None
        self._captures.clear()
        self._switch_tables.clear()

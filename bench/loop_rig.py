"""The loop served in-process over a real shared-memory ring: what tests and the loop's stress bench
drive, so that they exercise the engine's own pieces (LoopStep, DeviceLoop, MappedRegion) without
an engine process around them.

The rig plays the engine host thread's part (heartbeat, RUNNING, launch, shutdown) and leaves the
front end's part to an EngineClient attached to the same region, as `up` does across processes.
On CUDA the ring is mapped into the GPU (MappedRegion); on the CPU (mode "host" under the Triton
interpreter) the kernels read the shared buffer directly.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from blink_appliance.engine.loop.control import Backoff, LoopControl
from blink_appliance.engine.loop.graph import DeviceLoop
from blink_appliance.engine.loop.mapped_region import MappedRegion, RingWords
from blink_appliance.engine.loop.state import LoopGeometry
from blink_appliance.engine.loop.step import LoopStep, StepForward
from blink_appliance.model.gpu_weights import GpuWeights
from blink_appliance.model.loaders import Checkpoint
from blink_appliance.wire.client import EngineClient
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.ring_layout import EngineState, RingGeometry, RingLayout, region_size
from blink_appliance.wire.shm_transport import ShmTransport


@dataclass
class LoopRig:
    transport: ShmTransport
    ring_geometry: RingGeometry
    region: RingRegion
    step: LoopStep
    mapped: MappedRegion | None = None
    loop: DeviceLoop | None = None  # None: host-driven, one host_step() per beat()

    @classmethod
    def build(
        cls,
        ring_geometry: RingGeometry,
        geometry: LoopGeometry,
        *,
        checkpoint: Checkpoint | None = None,
        dtype: torch.dtype = torch.float32,
        forward: StepForward | None = None,
        device: torch.device | str = "cpu",
        in_loop: bool = False,
        engine_seed: int = 7,
        backoff: Backoff = Backoff(),
    ) -> LoopRig:
        """A fresh ring and a LoopStep over it: the real GpuForward from `checkpoint`'s weights, or
        an existing `forward` (LoopStep.assemble). `in_loop` captures the DeviceLoop (CUDA only)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        name = f"blink-rig-{os.getpid()}-{time.monotonic_ns()}"
        transport = ShmTransport.create(name, region_size(ring_geometry))
        mapped = loop = None
        try:
            region = RingRegion.create(transport, ring_geometry)
            if device.type == "cuda":
                mapped = MappedRegion.of_transport(transport, device)
                ring = mapped.tensor(0, torch.uint8, mapped.size)
            else:
                ring = torch.frombuffer(transport.buffer, dtype=torch.uint8)
            layout = RingLayout.of(ring_geometry)
            if forward is not None:
                step = LoopStep.assemble(geometry, forward, ring, layout, engine_seed=engine_seed)
            else:
                if checkpoint is None:
                    raise ValueError("LoopRig.build needs a checkpoint or a forward")
                weights = GpuWeights.from_hf(checkpoint.config, checkpoint.weights, dtype, device)
                step = LoopStep.build(
                    checkpoint.config, weights, ring, layout, geometry, device, dtype, engine_seed=engine_seed
                )
            step.warmup()
            if in_loop:
                if mapped is None:
                    raise ValueError("the device loop needs a CUDA device")
                loop = DeviceLoop(
                    step.body(), num_active=step.state.num_active, keep_running=step.state.keep_running,
                    ring=RingWords.of(mapped), control=LoopControl(device), backoff=backoff,
                )  # fmt: skip
        except BaseException:
            if mapped is not None:
                mapped.close()
            transport.close()
            raise
        return cls(transport, ring_geometry, region, step, mapped, loop)

    def client(self, stall_limit_s: float = 600.0) -> EngineClient:
        """A front end's client on this ring (start() it inside the event loop that reads it)."""
        return EngineClient.attach(self.transport, self.ring_geometry, stall_limit_s=stall_limit_s)

    def start(self) -> None:
        """What the engine host thread does once the loop is ready: heartbeat, RUNNING, launch."""
        self.heartbeat()
        self.region.store("engine_state", EngineState.RUNNING)
        if self.loop is not None:
            self.loop.launch()

    def heartbeat(self) -> None:
        self.region.store("engine_heartbeat_ns", time.monotonic_ns())

    def beat(self) -> None:
        """One tick of the host side: the heartbeat, and one host_step() when host-driven. Raises
        if the device loop has ended on its own (it must run until shutdown)."""
        self.heartbeat()
        if self.loop is None:
            self.step.host_step()
        elif not self.loop.running():
            raise RuntimeError("the device loop ended without a shutdown request")

    def stop(self, timeout_s: float = 1.0) -> float:
        """Shutdown through the ring, as the daemon asks for it; seconds until the loop ended (one
        more host step when host-driven)."""
        t0 = time.monotonic()
        if self.loop is not None:
            self.loop.stop(timeout_s)
        else:
            self.region.store("shutdown", 1)
            self.step.host_step()
        return time.monotonic() - t0

    def shut_down(self) -> None:
        """Stop the device loop if it still runs, then close: a bench's teardown."""
        if self.loop is not None and self.loop.running():
            self.loop.stop(timeout_s=5.0)
        self.close()

    def close(self) -> None:
        """Free the loop and unmap the ring. A loop that is still running keeps its mapping: unmapping
        memory a kernel polls would fault it."""
        if self.loop is not None:
            if self.loop.running():
                raise RuntimeError("close() while the device loop runs: stop() it first")
            self.loop.close()
        if self.step.state.keep_running.is_cuda:
            torch.cuda.synchronize(self.step.state.keep_running.device)
        if self.mapped is not None:
            self.mapped.close()
        self.transport.close()

"""The device loop's control kernels (kernels/loop_control.cu): compiled once with NVRTC, launched on
torch's current stream so that a torch graph capture records them as kernel nodes.

- `set_while` / `set_switch`: write a conditional node's value from the device
  (cudaGraphSetConditional); the handle is a plain 64-bit kernel argument, fixed at capture.
- `set_switches`: the values of several SWITCH nodes in one launch (handles and value pointers in
  device arrays the caller keeps alive as long as the graph).
- `wait_and_set_while`: the end of an iteration: while the body runs again, the idle poll first
  (it spins with __nanosleep backoff while no slot is active, the request ring is empty and shutdown
  is not set), then the WHILE condition.
- `stamp_globaltimer`: the device clock, for `measure_clock_offset_ns` and latency stamps.

A conditional handle is only valid inside the graph it belongs to: never launch set_while or
set_switch outside a capture.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import blink_appliance.kernels
from blink_appliance.engine.loop.mapped_region import RingWords

KERNEL_FILE = Path(blink_appliance.kernels.__file__).with_name("loop_control.cu")
KERNELS = (
    "wait_and_set_while",
    "set_while",
    "set_switch",
    "set_switches",
    "stamp_globaltimer",
)
MAX_NANOSLEEP_NS = 1_000_000  # __nanosleep's documented ceiling


def kernel_source() -> str:
    return KERNEL_FILE.read_text()


@dataclass(frozen=True)
class Backoff:
    """Idle poll sleeps: from min_sleep_ns, doubling, up to max_sleep_ns.

    max_sleep_ns bounds how late an idle loop notices a request; min_sleep_ns how fast it polls
    right after going idle. min_sleep_ns = max_sleep_ns = 0 spins (only for comparisons).
    """

    min_sleep_ns: int = 1_000
    max_sleep_ns: int = 100_000

    def __post_init__(self) -> None:
        if not 0 <= self.min_sleep_ns <= self.max_sleep_ns <= MAX_NANOSLEEP_NS:
            raise ValueError(
                f"backoff needs 0 <= min_sleep_ns ({self.min_sleep_ns}) <= max_sleep_ns "
                f"({self.max_sleep_ns}) <= {MAX_NANOSLEEP_NS}"
            )


def _pointer(t: torch.Tensor, dtype: torch.dtype, device: torch.device, what: str) -> np.uint64:
    if t.device != device or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous {dtype} tensor on {device}, got {t.dtype} on {t.device}"
        )
    return np.uint64(t.data_ptr())


class LoopControl:
    """The compiled control kernels for one CUDA device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"loop control kernels need a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("the GPU loop needs cupy (pip install 'blink-appliance[gpu]')") from exc
        self._cupy = cupy
        torch.cuda.init()
        with cupy.cuda.Device(self.device.index):
            self._module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",))
            # Loading the module now keeps module loads out of graph captures.
            self._kernels = {name: self._module.get_function(name) for name in KERNELS}

    def _launch(self, name: str, *args: object) -> None:
        cp = self._cupy
        stream = torch.cuda.current_stream(self.device)
        with cp.cuda.Device(self.device.index), cp.cuda.ExternalStream(stream.cuda_stream, self.device.index):
            self._kernels[name]((1,), (1,), args)

    def wait_and_set_while(
        self,
        handle: int,
        keep_running: torch.Tensor,
        num_active: torch.Tensor,
        ring: RingWords,
        backoff: Backoff,
    ) -> None:
        self._launch(
            "wait_and_set_while",
            np.uint64(handle),
            _pointer(keep_running, torch.int32, self.device, "keep_running"),
            *self._poll_args(num_active, ring, backoff),
        )

    def _poll_args(self, num_active: torch.Tensor, ring: RingWords, backoff: Backoff) -> tuple[object, ...]:
        return (
            _pointer(num_active, torch.int32, self.device, "num_active"),
            _pointer(ring.req_head, torch.int64, self.device, "req_head"),
            _pointer(ring.req_tail, torch.int64, self.device, "req_tail"),
            _pointer(ring.shutdown, torch.int64, self.device, "shutdown"),
            np.uint32(backoff.min_sleep_ns),
            np.uint32(backoff.max_sleep_ns),
        )

    def set_while(self, handle: int, keep_running: torch.Tensor) -> None:
        self._launch(
            "set_while", np.uint64(handle), _pointer(keep_running, torch.int32, self.device, "keep_running")
        )

    def set_switch(self, handle: int, value: torch.Tensor) -> None:
        self._launch(
            "set_switch", np.uint64(handle), _pointer(value, torch.int32, self.device, "switch value")
        )

    def switch_table(self, handles: Sequence[int], values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The device array `set_switches` reads: n handles, then n value pointers. Build it before the
        capture (a copy to the device is not capturable) and keep it alive as long as the graph."""
        if len(handles) != len(values) or not handles:
            raise ValueError(
                f"a switch table needs as many values as handles, got {len(handles)} / {len(values)}"
            )
        words = [int(h) for h in handles] + [
            int(_pointer(v, torch.int32, self.device, "switch value")) for v in values
        ]
        return torch.tensor(np.array(words, dtype=np.uint64).view(np.int64)).to(self.device)

    def set_switches(self, table: torch.Tensor) -> None:
        """One launch that sets the SWITCH nodes of a `switch_table`."""
        n = table.numel() // 2
        if table.dtype != torch.int64 or table.device != self.device or table.numel() != 2 * n or not n:
            raise ValueError("set_switches needs a switch_table of this device")
        self._launch(
            "set_switches", np.uint64(table.data_ptr()), np.uint64(table.data_ptr() + 8 * n), np.int32(n)
        )

    def stamp_globaltimer(self, out: torch.Tensor) -> None:
        """Write the device clock (ns) into out[0] (int64)."""
        self._launch("stamp_globaltimer", _pointer(out, torch.int64, self.device, "stamp"))

    def measure_clock_offset_ns(self, samples: int = 50) -> tuple[int, int]:
        """(host time.monotonic_ns() minus device %globaltimer, uncertainty in ns).

        Each sample brackets one stamp kernel between two host clock reads; the offset comes from
        the tightest bracket, taking the kernel to have run at its midpoint. Must not run while
        something else keeps the device busy.
        """
        out = torch.zeros(1, dtype=torch.int64, device=self.device)
        stream = torch.cuda.Stream(self.device)
        best: tuple[int, int] | None = None
        with torch.cuda.stream(stream):
            self.stamp_globaltimer(out)  # warm up the launch path
            stream.synchronize()
            for _ in range(samples):
                t0 = time.monotonic_ns()
                self.stamp_globaltimer(out)
                stream.synchronize()
                t1 = time.monotonic_ns()
                offset, width = (t0 + t1) // 2 - int(out.item()), t1 - t0
                if best is None or width < best[1]:
                    best = (offset, width)
        assert best is not None
        return best[0], best[1] // 2

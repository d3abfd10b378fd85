"""The shared region, mapped into the GPU: host memory the loop's kernels read and write directly.

The ring lives in POSIX shared memory (shm_transport.py), written by the front end in another
process. Registering that memory with cudaHostRegister(..., cudaHostRegisterMapped) pins it and
gives it a device address (equal to the host address under UVA), so a kernel can poll a word the
front end writes, and the front end can read tokens the GPU writes, with no copy and no host thread
in between (ARCHITECTURE.md fact 4).

`tensor()` wraps a range of it as a CUDA tensor (no copy, no ownership) for Triton and torch ops;
`word()` does so for one u64 control word. Reads and writes of such a tensor cross the bus on every
access: kernels that poll must use volatile loads (Triton `tl.load(..., volatile=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blink_appliance.wire.ring_layout import RingLayout
from blink_appliance.wire.shm_transport import ShmTransport


def cudart():
    """cuda-bindings' runtime module, or a clear error where it is missing (CPU-only installs)."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("the GPU loop needs cuda-bindings (pip install 'blink-appliance[gpu]')") from exc
    return runtime


def check(result: tuple) -> tuple:
    """Unpack a cuda-bindings call's (error, *values); raise on any error."""
    rt = cudart()
    err, *values = result
    if err != rt.cudaError_t.cudaSuccess:
        _, name = rt.cudaGetErrorName(err)
        _, text = rt.cudaGetErrorString(err)
        raise RuntimeError(f"CUDA runtime error {name.decode()}: {text.decode()}")
    return tuple(values)


class _CudaArray:
    """The minimal __cuda_array_interface__ torch.as_tensor needs to wrap foreign device memory."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str, owner: object) -> None:
        self.owner = owner  # the tensor keeps this object (and so the mapping) alive
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }


_TYPESTR = {
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.uint8: "|u1",
    torch.float32: "<f4",
}


class MappedRegion:
    """A writable host buffer pinned and mapped for `device`; unregistered by close()."""

    def __init__(self, buffer: memoryview | np.ndarray, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"a mapped region needs a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._array = np.frombuffer(buffer, dtype=np.uint8)  # holds the buffer while mapped
        if self._array.flags.writeable is False:
            raise ValueError("a mapped region needs a writable buffer")
        self.size = self._array.nbytes
        self.host_pointer = self._array.ctypes.data
        rt = cudart()
        with torch.cuda.device(self.device):
            torch.cuda.init()  # the primary context torch uses must exist before registration
            check(rt.cudaHostRegister(self.host_pointer, self.size, rt.cudaHostRegisterMapped))
            try:
                (self.device_pointer,) = check(rt.cudaHostGetDevicePointer(self.host_pointer, 0))
                self.device_pointer = int(self.device_pointer)
            except Exception:
                check(rt.cudaHostUnregister(self.host_pointer))
                raise
        self._closed = False

    @classmethod
    def of_transport(cls, transport: ShmTransport, device: torch.device | str) -> MappedRegion:
        """Map the region of a shared-memory transport (offsets as in ring_layout)."""
        # ShmTransport exposes no buffer publicly; the region view is the one it reads and writes.
        return cls(transport.buffer, device)

    # -- device views ---------------------------------------------------------------------------
    def tensor(self, offset: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """`count` elements of `dtype` at byte `offset`, as a CUDA tensor over the mapped memory.

        The tensor does not own the memory: it must not be used after close().
        """
        self._check_open()
        if dtype not in _TYPESTR:
            raise ValueError(f"unsupported dtype {dtype} for a mapped view")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset % itemsize or offset < 0 or count < 1 or offset + itemsize * count > self.size:
            raise ValueError(
                f"view of {count} x {dtype} at {offset} is misaligned or outside {self.size} bytes"
            )
        array = _CudaArray(self.device_pointer + offset, (count,), _TYPESTR[dtype], self)
        view = torch.as_tensor(array, device=self.device)
        if view.data_ptr() != self.device_pointer + offset:
            raise RuntimeError("torch copied the mapped memory instead of wrapping it")
        return view

    def word(self, offset: int) -> torch.Tensor:
        """One u64 word as an int64 tensor of shape [1] (ring words stay below 2**63)."""
        return self.tensor(offset, torch.int64, 1)

    # -- host access ----------------------------------------------------------------------------
    def load_u64(self, offset: int) -> int:
        return int(self._u64_host(offset)[offset >> 3])

    def store_u64(self, offset: int, value: int) -> None:
        self._u64_host(offset)[offset >> 3] = value

    def _u64_host(self, offset: int) -> np.ndarray:
        self._check_open()
        if offset % 8 or not 0 <= offset <= self.size - 8:
            raise ValueError(f"u64 access at {offset}: not 8-byte aligned or outside {self.size} bytes")
        return self._array[: self.size - self.size % 8].view("<u8")

    # -- life cycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Unregister (unpin) the memory. No kernel may still be reading it."""
        if self._closed:
            return
        self._closed = True
        rt = cudart()
        with torch.cuda.device(self.device):
            check(rt.cudaHostUnregister(self.host_pointer))
        self._array = None  # release the buffer: its owner (e.g. ShmTransport) can unmap it now

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("mapped region is closed")

    def __enter__(self) -> MappedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class RingWords:
    """The ring control words the loop's kernels poll and write, as mapped int64 [1] tensors."""

    region: MappedRegion
    req_head: torch.Tensor  # front end: records published
    req_tail: torch.Tensor  # schedule: records consumed
    shutdown: torch.Tensor  # daemon / front end: 1 = stop the loop

    @classmethod
    def of(cls, region: MappedRegion) -> RingWords:
        return cls(
            region=region,
            req_head=region.word(RingLayout.control("req_head")),
            req_tail=region.word(RingLayout.control("req_tail")),
            shutdown=region.word(RingLayout.control("shutdown")),
        )

    def request_shutdown(self) -> None:
        """Host side: ask the loop to stop (what the daemon does through the ring)."""
        self.region.store_u64(RingLayout.control("shutdown"), 1)

"""Transport over POSIX shared memory (multiprocessing.shared_memory), for ends on one host.

The segment starts with a 64-byte preamble this module owns (magic, owner pid and the owner's
process start time); the region the ring uses follows it. The preamble lets a new owner tell a
segment left by a crashed run (owner gone) from one in use, and replace only the former.

Python < 3.13 registers every SharedMemory it creates *or opens* with the resource tracker, which
unlinks "leaked" segments when a process exits, including segments that process did not create:
an engine process exiting would delete the region under the daemon. We take every segment out of
the tracker right after opening it and unlink only from the owner's close.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import psutil

from blink_appliance.wire.transport import Transport

PREAMBLE_BYTES = 64
_SHM_MAGIC = int.from_bytes(b"BLINKSHM", "little")
_TRACK_KW = {"track": False} if sys.version_info >= (3, 13) else {}


class RegionInUseError(RuntimeError):
    """A segment with this name exists and its owner process is alive, or another user owns it."""


def _check_ours(shm: shared_memory.SharedMemory, name: str) -> None:
    """Refuse a segment another user created: its header could name any live process (a squatter
    blocking our start), and it is not ours to remove or to trust."""
    st = os.fstat(shm._fd)
    if st.st_uid != os.getuid():
        raise RegionInUseError(
            f"shared-memory region {name!r} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
            "set appliance.shm_name to another name, or have its owner remove /dev/shm/" + name.lstrip("/")
        )


def _process_start_ticks(pid: int) -> int:
    """Start time of `pid` in ms (0 if it does not exist): guards against pid reuse."""
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def _untrack(shm: shared_memory.SharedMemory) -> None:
    if not _TRACK_KW:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


class ShmTransport(Transport):
    def __init__(self, shm: shared_memory.SharedMemory, size: int, *, owner: bool) -> None:
        self._shm = shm
        self._size = size
        self._owner = owner
        self._buf = shm.buf[PREAMBLE_BYTES : PREAMBLE_BYTES + size]
        self._u64 = np.ndarray(size // 8, dtype="<u8", buffer=self._buf)
        self._closed = False

    # -- life cycle ----------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, size: int, *, replace_stale: bool = True) -> ShmTransport:
        """Create segment `name` holding a zeroed region of `size` bytes; this process owns it.

        An existing segment whose owner is dead is unlinked and replaced (when `replace_stale`);
        one whose owner is alive raises RegionInUseError.
        """
        if size <= 0 or size % 8:
            raise ValueError(f"region size must be a positive multiple of 8, got {size}")
        try:
            shm = shared_memory.SharedMemory(name, create=True, size=PREAMBLE_BYTES + size, **_TRACK_KW)
        except FileExistsError:
            cls._remove_stale(name, replace_stale)
            shm = shared_memory.SharedMemory(name, create=True, size=PREAMBLE_BYTES + size, **_TRACK_KW)
        _untrack(shm)
        pre = np.ndarray(PREAMBLE_BYTES // 8, dtype="<u8", buffer=shm.buf)
        pre[1] = os.getpid()
        pre[2] = _process_start_ticks(os.getpid())
        pre[3] = size
        pre[0] = _SHM_MAGIC  # last: a segment without it was never finished
        return cls(shm, size, owner=True)

    @classmethod
    def open(cls, name: str) -> ShmTransport:
        """Map an existing segment created by `create` (in any process)."""
        try:
            shm = shared_memory.SharedMemory(name, create=False, **_TRACK_KW)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory region {name!r} does not exist") from None
        _untrack(shm)
        pre = np.ndarray(PREAMBLE_BYTES // 8, dtype="<u8", buffer=shm.buf).copy()
        if int(pre[0]) != _SHM_MAGIC:
            shm.close()
            raise ValueError(f"shared-memory segment {name!r} is not a blink region (bad preamble)")
        return cls(shm, int(pre[3]), owner=False)

    @classmethod
    def _remove_stale(cls, name: str, replace_stale: bool) -> None:
        shm = shared_memory.SharedMemory(name, create=False, **_TRACK_KW)
        _untrack(shm)
        try:
            _check_ours(shm, name)
            pre = None
            if shm.size >= PREAMBLE_BYTES:
                pre = np.ndarray(PREAMBLE_BYTES // 8, dtype="<u8", buffer=shm.buf).copy()
            if pre is not None and int(pre[0]) == _SHM_MAGIC:
                pid, started = int(pre[1]), int(pre[2])
                if pid and _process_start_ticks(pid) == started and started != 0:
                    raise RegionInUseError(f"shared-memory region {name!r} is in use by live process {pid}")
            if not replace_stale:
                raise FileExistsError(f"stale shared-memory region {name!r} exists (owner gone)")
        finally:
            shm.close()
        _unlink(name)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def owner(self) -> bool:
        return self._owner

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._u64
        self._buf.release()
        self._shm.close()
        if self._owner:
            _unlink(self._shm.name)

    # -- access ---------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        """The region's bytes, for those that access it in place (the loop's kernels, through a tensor
        over it or its GPU mapping). Valid until close()."""
        self._check_open()
        return self._buf

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_open()
        self._check(offset, nbytes)
        return bytes(self._buf[offset : offset + nbytes])

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        self._check(offset, view.nbytes)
        self._buf[offset : offset + view.nbytes] = view

    def load_u64(self, offset: int) -> int:
        # One aligned 8-byte load; on x86 (TSO) loads are not reordered with later loads.
        self._check_word(offset)
        return int(self._u64[offset >> 3])

    def store_u64(self, offset: int, value: int) -> None:
        # One aligned 8-byte store; x86 keeps stores in program order.
        self._check_word(offset)
        self._u64[offset >> 3] = value

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"shared-memory transport {self._shm.name!r} is closed")

    def _check_word(self, offset: int) -> None:
        self._check_open()
        if offset & 7 or not 0 <= offset <= self._size - 8:
            raise ValueError(f"u64 access at {offset}: not 8-byte aligned or outside the region")


def _unlink(name: str) -> None:
    """Unlink a segment without unbalancing the resource tracker (see module docstring)."""
    # On 3.11/3.12 the constructor registers the name and unlink() unregisters it: balanced.
    shm = shared_memory.SharedMemory(name, create=False, **_TRACK_KW)
    shm.close()
    shm.unlink()

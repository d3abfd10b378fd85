"""The Transport interface: how an end reaches the shared region, whatever carries the bytes.

Both ends touch the region only through these calls, so a transport that moves bytes over RDMA
(a DPU front end writing into GPU memory) can replace shared memory without changing the ring
logic on either side. Offsets are byte offsets from the start of the region.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence


class TransportLost(ConnectionError):
    """The link behind a remote transport failed; nothing more goes through it (shared memory never
    raises it). The client fails its open streams and waits to be rebound to a new link."""


class Transport(ABC):
    """A mapped region of `size` bytes with ordered writes.

    Ordering contract (docs/protocol.md, "Publication order"):
    - `write` and `store_u64` calls become visible to the other side in program order;
    - `store_u64` / `doorbell` of an 8-byte aligned word is single-copy atomic (never torn);
    - `load_u64` is an acquire: reads issued after it see everything the writer published before
      the value it returned.
    """

    @property
    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of `nbytes` at `offset` (a snapshot: later writes do not change it)."""

    @abstractmethod
    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def load_u64(self, offset: int) -> int:
        """Acquire-load of an aligned little-endian u64."""

    @abstractmethod
    def store_u64(self, offset: int, value: int) -> None:
        """Release-store of an aligned little-endian u64: earlier writes are visible first."""

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes made inside may land in any order among themselves, all before any write made after
        the block: payload that one later word publishes. Shared memory writes each at once; a remote
        transport sends them as one transfer. No reads inside."""
        yield

    def read_many(self, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        """A copy of each (offset, nbytes) span, read after everything loaded before the call (one
        transfer on a remote transport; no order among the spans)."""
        return [self.read(offset, nbytes) for offset, nbytes in spans]

    def doorbell(self, offset: int, value: int) -> None:
        """Publish a producer counter: a release-store that tells the polling side work is there.

        Over shared memory the poller spins on the word itself, so this is the store; an RDMA
        transport overrides it to complete earlier writes before the counter lands.
        """
        self.store_u64(offset, value)

    @abstractmethod
    def close(self) -> None:
        """Unmap; the region's owner also removes it."""

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"access [{offset}, {offset + nbytes}) outside region of {self.size} bytes")

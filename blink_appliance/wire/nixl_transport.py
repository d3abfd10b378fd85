"""Transport over NIXL: a front end anywhere on the network reaches a ring region with one-sided
WRITEs and READs into the engine host's memory (RDMA where the NIC has it, else TCP or shared memory).

Ordering (docs/protocol.md, "Publication order"): every call is one NIXL transfer, posted only after
the one before it completed. NIXL's UCX backend completes a transfer after flushing its endpoint,
that is once the target's memory holds it, so separate transfers land in the order they were posted
and a publishing word written after its payload is never seen before it. Within one transfer there
is no order, so a payload and the word that publishes it are never written by the same call. A READ
posted after another completed sees memory no older than the first one did.

A transfer that fails or does not complete within the link's timeout marks the whole link lost:
every later call raises TransportLost until a new link replaces it (the front end's client fails its
open streams and rebinds to the new one).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from blink_appliance.wire.handshake import Offer, RemoteRegion
from blink_appliance.wire.transport import Transport, TransportLost

# A transfer not complete after this long marks the link lost. Each one blocks its caller (the front
# end's event loop) while it runs, so this stays well under the engine's 5 s front-end timeout.
TRANSFER_TIMEOUT_S = 1.0


class NixlLink:
    """This process's NIXL agent joined to one ring agent (the offer it made after the handshake)."""

    def __init__(self, agent: Any, offer: Offer, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self.agent = agent
        self.offer = offer
        self.timeout_s = timeout_s
        self.lost: str | None = None
        try:
            remote = agent.add_remote_agent(offer.metadata)
            self.remote = remote.decode() if isinstance(remote, bytes) else remote
            agent.make_connection(self.remote)
        except Exception as e:  # noqa: BLE001 - NIXL's binding raises its own error classes
            raise ConnectionError(f"NIXL could not connect to ring agent {offer.agent_name}: {e}") from None
        self._transports: dict[str, NixlTransport] = {}

    @staticmethod
    def agent_name() -> str:
        return f"blink-frontend-{uuid.uuid4().hex[:12]}"

    def transport(self, model: str) -> NixlTransport:
        """Model `model`'s region through this link (one transport per model)."""
        if model in self._transports:
            return self._transports[model]
        region = next((r for r in self.offer.regions if r.model == model), None)
        if region is None:
            offered = ", ".join(r.model for r in self.offer.regions) or "none"
            raise ValueError(f"the ring agent offers no region for model {model!r} (it offers {offered}): "
                             "are both ends running the same profile?")  # fmt: skip
        transport = self._transports[model] = NixlTransport(self, region)
        return transport

    def mark_lost(self, why: str) -> None:
        if self.lost is None:
            self.lost = why

    def close(self) -> None:
        """Forget the remote agent and unregister local memory (best effort: the peer may be gone)."""
        self.mark_lost("link closed")
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
        try:
            self.agent.remove_remote_agent(self.remote)
        except Exception:  # noqa: BLE001 - NIXL raises its own classes; a dead peer is fine here
            pass


class NixlTransport(Transport):
    """One model's region, reached through a NixlLink; a local buffer of the region's size stages
    what each transfer moves (at the same offsets)."""

    def __init__(self, link: NixlLink, region: RemoteRegion) -> None:
        self._link = link
        self._region = region
        self._local = np.zeros(region.size, dtype=np.uint8)
        self._base = self._local.ctypes.data
        self._registered = link.agent.register_memory([(self._base, region.size, 0, "")], "DRAM")
        self._closed = False
        self._batched: list[tuple[int, int]] | None = None  # writes staged inside batch()

    @property
    def size(self) -> int:
        return self._region.size

    @property
    def link(self) -> NixlLink:
        return self._link

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.read_many([(offset, nbytes)])[0]

    def read_many(self, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        if self._batched is not None:
            raise RuntimeError("a read inside a write batch: the batch's writes have not been sent")
        for offset, nbytes in spans:
            self._check(offset, nbytes)
        self._move("READ", [(o, n) for o, n in spans if n])
        return [self._local[o : o + n].tobytes() for o, n in spans]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        self._check(offset, view.size)
        if view.size:
            self._local[offset : offset + view.size] = view
            if self._batched is not None:
                self._batched.append((offset, view.size))
            else:
                self._move("WRITE", [(offset, view.size)])

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The writes inside go as one transfer (several descriptors) when the block ends: no order
        among them, all complete before the next call's transfer is posted."""
        if self._batched is not None:  # nested: the outer block sends them
            yield
            return
        self._batched = []
        try:
            yield
            spans = self._batched
        finally:
            self._batched = None
        self._move("WRITE", spans)

    def load_u64(self, offset: int) -> int:
        self._check_word(offset)
        return int.from_bytes(self.read(offset, 8), "little")

    def store_u64(self, offset: int, value: int) -> None:
        self._check_word(offset)
        self.write(offset, int(value).to_bytes(8, "little"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._link.agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001 - best effort, the agent may be going away too
            pass

    def _move(self, op: str, spans: Sequence[tuple[int, int]]) -> None:
        """One transfer of every (offset, nbytes) span, waited on to completion (see the module
        docstring for why each one is)."""
        if not spans:
            return
        link = self._link
        if self._closed:
            raise TransportLost("the NIXL transport is closed")
        if link.lost is not None:
            raise TransportLost(link.lost)
        agent = link.agent
        handle = None
        nbytes, offset = sum(n for _, n in spans), spans[0][0]
        try:
            local = agent.get_xfer_descs([(self._base + o, n, 0) for o, n in spans], "DRAM")
            remote = agent.get_xfer_descs([(self._region.address + o, n, 0) for o, n in spans], "DRAM")
            handle = agent.initialize_xfer(op, local, remote, link.remote)
            state = agent.transfer(handle)
            deadline = time.monotonic() + link.timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    state = f"not complete after {link.timeout_s:g} s"
                    handle = None  # still posted: releasing it now is not allowed
                    break
                state = agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - NIXL's binding raises its own error classes
            state = f"{type(e).__name__}: {e}"
        if state != "DONE":
            where = (
                f"at offset {offset}" if len(spans) == 1 else f"in {len(spans)} spans from offset {offset}"
            )
            link.mark_lost(f"NIXL {op} of {nbytes} bytes {where} failed ({state})")
            raise TransportLost(link.lost)
        agent.release_xfer_handle(handle)

    def _check_word(self, offset: int) -> None:
        if offset & 7 or not 0 <= offset <= self.size - 8:
            raise ValueError(f"u64 access at {offset}: not 8-byte aligned or outside the region")

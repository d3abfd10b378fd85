"""The ring agent: on the engine host, it lends every model's ring region to a remote front end.

Started by the daemon in place of the local front end when `frontend.transport = "nixl"`
(`python -m blink_appliance.ring_agent PROFILE`). It maps each region the daemon created, registers
them with a NIXL agent (UCX backend) and listens on `[dpu] listen`:`port`, that interface only. A
front end that proves the shared secret (wire/handshake.py) gets the agent's NIXL metadata and the
regions' addresses; from then on it WRITEs requests and READs tokens itself, and this process only
runs UCX's progress thread, which TCP and shared-memory transports need and RDMA does not. It holds
no request state: restarting it costs the front end a reconnect, and no accepted request is lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

from blink_appliance.processes import set_on_signals, watch_parent
from blink_appliance.profile import Profile, ProfileError, load_profile, region_name
from blink_appliance.wire.handshake import HandshakeError, Offer, RemoteRegion, load_secret, serve_handshake
from blink_appliance.wire.link_settings import DpuSection
from blink_appliance.wire.nixl_agent import NixlUnavailableError, apply_ucx_env, interface_of, make_agent
from blink_appliance.wire.shm_transport import ShmTransport

log = logging.getLogger("blink_appliance.ring_agent")
_MAX_HANDSHAKES = 8  # at once; more connections wait in the listen backlog


def ucx_env(dpu: DpuSection, address: str) -> dict[str, str]:
    """[dpu]'s UCX settings; without ucx_devices (in the profile or the environment), UCX uses the
    interface that holds `address` only, so the agent is reachable where it listens and nowhere else.
    That interface carries TCP: an RDMA NIC is used only when ucx_devices names it (mlx5_0:1)."""
    env = dpu.ucx_env()
    if "UCX_NET_DEVICES" not in env and "UCX_NET_DEVICES" not in os.environ:
        iface = interface_of(address)
        if iface is not None:
            env["UCX_NET_DEVICES"] = iface
    return env


def listen_on(dpu: DpuSection) -> socket.socket:
    """The handshake socket, bound to `[dpu] listen` alone (never every interface)."""
    family = socket.AF_INET6 if ":" in dpu.listen else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((dpu.listen, dpu.port))
    except OSError as e:
        sock.close()
        raise ProfileError(
            f"dpu.listen/dpu.port: cannot listen on {dpu.listen}:{dpu.port} ({e.strerror})"
        ) from None
    sock.listen(64)
    sock.settimeout(0.2)
    return sock


class RingAgent:
    def __init__(self, profile: Profile) -> None:
        if profile.dpu is None:
            raise ProfileError("the ring agent serves profiles with frontend.transport = 'nixl' only")
        self.dpu = profile.dpu
        self.secret = load_secret(self.dpu.secret_file)
        self.instance = uuid.uuid4().hex
        apply_ucx_env(ucx_env(self.dpu, self.dpu.listen))
        self.transports = [ShmTransport.open(region_name(profile, i)) for i in range(len(profile.models))]
        try:
            self.agent = make_agent(f"blink-ring-agent-{self.instance[:12]}", progress_thread=True)
            regions = []
            for m, transport in zip(profile.models, self.transports, strict=True):
                address = np.frombuffer(transport.buffer, dtype=np.uint8).ctypes.data
                regions.append(RemoteRegion(m.name, address, transport.size))
            self.registered = self.agent.register_memory(
                [(r.address, r.size, 0, r.model) for r in regions], "DRAM"
            )
            self.offer = Offer(
                self.instance, self.agent.name, self.agent.get_agent_metadata(), tuple(regions)
            )
        except BaseException:  # the regions' mappings go with this process's failure, quietly
            for transport in self.transports:
                transport.close()
            raise
        self._slots = threading.BoundedSemaphore(_MAX_HANDSHAKES)

    def serve(self, sock: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                conn, peer = sock.accept()
            except TimeoutError:
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        try:
            with conn:
                conn.settimeout(self.dpu.connect_timeout_s)
                serve_handshake(conn, self.secret, self.offer)
            log.info("front end at %s:%d proved the secret; it has the rings' metadata", *peer[:2])
        except (HandshakeError, OSError) as e:
            log.warning("handshake with %s:%d refused: %s", peer[0], peer[1], e)
        finally:
            self._slots.release()

    def close(self) -> None:
        self.agent.deregister_memory(self.registered)
        for transport in self.transports:
            transport.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blink_appliance.ring_agent", description=__doc__)
    parser.add_argument("profile")
    parser.add_argument(
        "--ready-file", type=Path, default=None, help="write nixl://host:port here when listening"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides (see engine/process.py)
    stop = threading.Event()
    set_on_signals(stop, [signal.SIGTERM])
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, stop.set)
    try:
        profile = load_profile(args.profile)
        logging.basicConfig(
            level=profile.appliance.log_level.upper(), format="[ring-agent] %(levelname)s %(message)s"
        )
        agent = RingAgent(profile)
        sock = listen_on(agent.dpu)
    except (ProfileError, ValueError, OSError, NixlUnavailableError) as e:
        print(f"[ring-agent] {e}", file=sys.stderr)
        return 2
    where = f"nixl://{profile.dpu.listen}:{profile.dpu.port}"
    log.info("lending %d ring region(s) on %s", len(agent.transports), where)
    if args.ready_file is not None:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(where)
        tmp.replace(args.ready_file)
    try:
        agent.serve(sock, stop)
    finally:
        sock.close()
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The NIXL link's parts without an appliance: the shared-secret handshake, the order transfers land
in (docs/protocol.md, "Publication order", over the network), and a link that fails."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from blink_appliance.wire.handshake import (
    MIN_SECRET_BYTES,
    HandshakeError,
    Offer,
    RemoteRegion,
    load_secret,
    request_offer,
    serve_handshake,
)

SECRET = b"s" * MIN_SECRET_BYTES
OFFER = Offer("instance-1", "agent-1", b"\x00metadata\xff", (RemoteRegion("m", 4096, 1 << 20),))


def _agent_once(secret: bytes, offer: Offer = OFFER) -> tuple[int, list[BaseException | None]]:
    """A listening socket that serves one handshake; returns its port and where its outcome lands."""
    server = socket.create_server(("127.0.0.1", 0))
    outcome: list[BaseException | None] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn, server:
            conn.settimeout(5)
            try:
                serve_handshake(conn, secret, offer)
                outcome.append(None)
            except HandshakeError as e:
                outcome.append(e)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1], outcome


def _wait(outcome: list) -> BaseException | None:
    deadline = time.monotonic() + 5
    while not outcome:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return outcome[0]


def test_a_front_end_with_the_secret_gets_the_offer():
    port, outcome = _agent_once(SECRET)
    assert request_offer("127.0.0.1", port, SECRET, 5) == OFFER
    assert _wait(outcome) is None


def test_a_wrong_secret_is_refused_on_both_sides():
    port, outcome = _agent_once(SECRET)
    with pytest.raises(HandshakeError, match="refused us"):
        request_offer("127.0.0.1", port, b"x" * MIN_SECRET_BYTES, 5)
    assert isinstance(_wait(outcome), HandshakeError)


def test_an_agent_without_the_secret_is_not_believed():
    """The front end checks the agent's proof too: an impostor's metadata is never used."""
    port, _ = _agent_once(b"y" * MIN_SECRET_BYTES)
    with pytest.raises(HandshakeError):
        request_offer("127.0.0.1", port, SECRET, 5)


def test_an_offer_changed_on_the_way_is_refused(monkeypatch):
    """The agent's proof covers its offer: one altered after it was signed does not verify."""
    import blink_appliance.wire.handshake as handshake

    real_send = handshake._send

    def tampering(sock, body):
        if "offer" in body:
            body = {**body, "offer": body["offer"].replace("4096", "8192")}
        real_send(sock, body)

    monkeypatch.setattr(handshake, "_send", tampering)
    port, _ = _agent_once(SECRET)
    with pytest.raises(HandshakeError, match="did not prove"):
        request_offer("127.0.0.1", port, SECRET, 5)


def test_a_peer_that_sends_a_huge_message_is_cut_off():
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn, server:
            conn.sendall((1 << 30).to_bytes(4, "big"))

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(HandshakeError, match="limit"):
        request_offer("127.0.0.1", server.getsockname()[1], SECRET, 5)


def test_an_unreachable_agent_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once it is closed
    with pytest.raises(ConnectionError, match="cannot reach the ring agent"):
        request_offer("127.0.0.1", port, SECRET, 2)


def test_the_secret_comes_from_env_or_file_and_must_be_long(tmp_path, monkeypatch):
    monkeypatch.delenv("BLINK_DPU_SECRET", raising=False)
    with pytest.raises(ValueError, match="dpu.secret_file: required"):
        load_secret(None)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 32 bytes"):
        load_secret(str(short))
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_text("k" * 40 + "\n")
    assert load_secret(str(good)) == b"k" * 40
    monkeypatch.setenv("BLINK_DPU_SECRET", "e" * 32)
    assert load_secret(str(good)) == b"e" * 32


# -- transfers through a real NIXL link (UCX), in a process of their own -------------------------------
# NIXL's binding, used in this process, disturbs CPython 3.11's recursion counter (a later ast.parse
# raised SystemError) and leaves UCX state a later agent here trips on: tests/nixl_link_probe.py runs
# both agents in a child process and reports what it saw.


@pytest.fixture(scope="module")
def probe() -> dict:
    pytest.importorskip("nixl_cu12", reason="the NIXL link needs nixl-cu12 (the dev extra installs it)")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("nixl_link_probe.py"))],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_publishing_word_written_after_its_payload_never_lands_before_it(probe):
    """Front end to engine: payload (a batch of two spans, one transfer), then the word that publishes
    it, a transfer of its own. A reader on the target that sees word i must see payload i or later in
    both spans, every time."""
    result = probe["write_order"]
    assert result["final_word"] == result["n"] and result["final_payload_min"] == result["n"]
    assert result["checks"] > result["n"] and not result["violations"], result


def test_a_read_after_the_publishing_word_sees_its_payload(probe):
    """Engine to front end: the target writes payload then word (x86 keeps stores in order); a front
    end that READs the word and then both payload spans (one read_many) must find them >= word."""
    result = probe["read_order"]
    assert result["last_seen"] > 10**6 and not result["violations"], result


def test_every_call_is_complete_when_it_returns(probe):
    """Each call's transfer has landed (or been read) before the call returns: what the order over
    the network rests on (a transport that returned on posting would fail here)."""
    assert probe["complete_on_return"]["late"] == {"store": 0, "write": 0, "batch": 0, "read": 0}, probe


def test_a_lost_link_refuses_every_later_transfer(probe):
    """Out of the region: refused locally. Once the link is marked lost (a transfer failed or timed
    out; the live test kills the agent for real), every call raises TransportLost at once."""
    assert probe["lost_link"] == {
        "out_of_region": "ValueError",
        "unknown_model": "ValueError",
        "load_after_lost": "TransportLost",
        "store_after_lost": "TransportLost",
    }


def test_the_ring_agent_reaches_ucx_only_through_the_listen_interface(monkeypatch):
    """Without ucx_devices, UCX is limited to the interface that holds `[dpu] listen`; the operator's
    UCX_NET_DEVICES (environment) or the profile's list wins over that."""
    from blink_appliance.ring_agent import ucx_env
    from blink_appliance.wire.link_settings import DpuSection
    from blink_appliance.wire.nixl_agent import interface_of

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    loopback = interface_of("127.0.0.1")
    assert loopback is not None
    assert ucx_env(DpuSection(listen="127.0.0.1"), "127.0.0.1") == {"UCX_NET_DEVICES": loopback}
    named = DpuSection(listen="127.0.0.1", ucx_devices=["mlx5_0:1"], ucx_transports=["rc", "cuda_copy"])
    assert ucx_env(named, "127.0.0.1") == {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_TLS": "rc,cuda_copy"}
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    assert ucx_env(DpuSection(listen="127.0.0.1"), "127.0.0.1") == {}
    assert interface_of("192.0.2.1") is None  # an address no interface here holds


def test_the_handshake_port_is_bound_to_the_listen_address_only(tmp_path):
    """The agent's socket is bound to `listen` alone: another of this host's addresses is refused."""
    import psutil

    from blink_appliance.ring_agent import listen_on
    from blink_appliance.wire.link_settings import DpuSection

    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not others:
        pytest.skip("this host has no IPv4 address besides loopback to try")
    dpu = DpuSection(listen="127.0.0.1", port=_free_port())
    sock = listen_on(dpu)
    try:
        socket.create_connection(("127.0.0.1", dpu.port), timeout=2).close()
        with pytest.raises(OSError):
            socket.create_connection((others[0], dpu.port), timeout=2)
    finally:
        sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_refuses_host_and_port_when_the_front_end_runs_elsewhere(tmp_path, capsys):
    from blink_appliance.daemon import run_up
    from blink_appliance.profile import parse_profile

    profile = parse_profile(
        {
            "models": [{"name": "m", "source": "dummy:tiny", "kv_budget_gib": 0.01, "max_model_len": 256}],
            "frontend": {"transport": "nixl"},
            "dpu": {"listen": "127.0.0.1"},
        }
    )
    assert run_up(profile, tmp_path / "p.toml", host=None, port=9001) == 2
    assert "give them to `blink-appliance frontend`" in capsys.readouterr().err


def test_a_front_end_on_another_host_than_frontend_host_says_so(monkeypatch, caplog):
    from blink_appliance.frontend import remote_rings

    from blink_appliance.wire.link_settings import DpuSection

    monkeypatch.setenv("BLINK_DPU_SECRET", "s" * MIN_SECRET_BYTES)
    monkeypatch.setattr(remote_rings, "make_agent", lambda *a, **k: object())  # no NIXL in this process
    with caplog.at_level("WARNING", logger=remote_rings.__name__):
        remote_rings.RemoteRings(DpuSection(frontend_host="127.0.0.1"), ["m"])
        assert not caplog.records
        remote_rings.RemoteRings(DpuSection(frontend_host="dpu-that-is-not-here.invalid"), ["m"])
    assert "is this the host the profile means?" in caplog.text

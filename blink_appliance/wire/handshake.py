"""The ring agent's handshake: a front end proves the shared secret before it learns anything.

Over one TCP connection, each message a 4-byte big-endian length and a JSON body:
  agent -> front end  {"version", "nonce"}                                   (32 random bytes, hex)
  front end -> agent  {"nonce", "proof"}       proof = HMAC(secret, "frontend" | agent nonce | own nonce)
  agent -> front end  {"proof", "offer"}       proof = HMAC(secret, "agent" | both nonces | offer JSON)
The agent answers a wrong proof with {"error"} and closes; the front end refuses an offer whose proof
does not verify, so neither side acts on a peer without the secret. The offer carries the agent's
NIXL metadata and where each model's region lies in the agent's memory. Nothing here is encrypted:
put the link on a private network (docs/dpu.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any

VERSION = 1
MIN_SECRET_BYTES = 32
_MAX_MESSAGE = 1 << 22  # NIXL metadata of one agent is kilobytes; more is not a peer of ours
ENV_SECRET = "BLINK_DPU_SECRET"


class HandshakeError(ConnectionError):
    """The peer did not prove the secret, or spoke something else."""


@dataclass(frozen=True)
class RemoteRegion:
    """One model's ring region as the agent registered it."""

    model: str
    address: int
    size: int


@dataclass(frozen=True)
class Offer:
    """What the agent hands a proven front end."""

    instance: str  # new each time an agent starts: a front end tells a restarted agent from a blip
    agent_name: str
    metadata: bytes  # nixl_agent.get_agent_metadata()
    regions: tuple[RemoteRegion, ...]

    def to_json(self) -> bytes:
        body = {
            "instance": self.instance,
            "agent_name": self.agent_name,
            "metadata": base64.b64encode(self.metadata).decode(),
            "regions": [[r.model, r.address, r.size] for r in self.regions],
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Offer:
        try:
            body = json.loads(raw)
            return cls(
                str(body["instance"]),
                str(body["agent_name"]),
                base64.b64decode(body["metadata"]),
                tuple(RemoteRegion(str(m), int(a), int(s)) for m, a, s in body["regions"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise HandshakeError(f"the agent's offer is malformed: {e}") from None


def load_secret(secret_file: str | None) -> bytes:
    """The shared secret: env BLINK_DPU_SECRET, else the file [dpu] secret_file names."""
    value = os.environ.get(ENV_SECRET)
    if value:
        raw = value.encode()
        where = f"env {ENV_SECRET}"
    elif secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            raise ValueError(f"dpu.secret_file: cannot read {secret_file!r} ({e.strerror})") from None
        where = f"dpu.secret_file ({secret_file})"
    else:
        raise ValueError(
            f"dpu.secret_file: required (or set {ENV_SECRET}): the ring agent admits no one without it"
        )
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: the secret must be at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
    return raw


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    sock.sendall(struct.pack(">I", len(raw)) + raw)


def _receive(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _exactly(sock, 4))
    if n > _MAX_MESSAGE:
        raise HandshakeError(f"a handshake message of {n} bytes (limit {_MAX_MESSAGE})")
    try:
        body = json.loads(_exactly(sock, n))
    except ValueError:
        raise HandshakeError("a handshake message is not JSON") from None
    if not isinstance(body, dict):
        raise HandshakeError("a handshake message is not a JSON object")
    return body


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def _hex_nonce(body: dict[str, Any], key: str) -> bytes:
    try:
        nonce = bytes.fromhex(str(body[key]))
    except (KeyError, ValueError):
        raise HandshakeError(f"handshake field {key!r} is missing or not hex") from None
    if len(nonce) != 32:
        raise HandshakeError(f"handshake field {key!r} must be 32 bytes")
    return nonce


def serve_handshake(sock: socket.socket, secret: bytes, offer: Offer) -> None:
    """The agent's side: raises HandshakeError (after telling the peer) when it fails the proof."""
    mine = secrets.token_bytes(32)
    _send(sock, {"version": VERSION, "nonce": mine.hex()})
    reply = _receive(sock)
    theirs = _hex_nonce(reply, "nonce")
    if not hmac.compare_digest(str(reply.get("proof", "")), _mac(secret, b"frontend", mine, theirs)):
        _send(sock, {"error": "the front end's proof of the shared secret is wrong"})
        raise HandshakeError("a peer failed the shared-secret proof")
    raw = offer.to_json()
    _send(sock, {"proof": _mac(secret, b"agent", mine, theirs, raw), "offer": raw.decode()})


def request_offer(address: str, port: int, secret: bytes, timeout_s: float) -> Offer:
    """The front end's side: connect, prove the secret, verify the agent's proof, return its offer."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout_s)
    except OSError as e:
        raise ConnectionError(f"cannot reach the ring agent at {address}:{port} ({e})") from None
    with sock:
        try:
            hello = _receive(sock)
            if hello.get("version") != VERSION:
                raise HandshakeError(
                    f"the agent speaks handshake version {hello.get('version')}, not {VERSION}"
                )
            theirs = _hex_nonce(hello, "nonce")
            mine = secrets.token_bytes(32)
            _send(sock, {"nonce": mine.hex(), "proof": _mac(secret, b"frontend", theirs, mine)})
            answer = _receive(sock)
        except HandshakeError:
            raise
        except OSError as e:  # HandshakeError is one too (a ConnectionError): it is raised as it is above
            raise ConnectionError(f"handshake with {address}:{port} failed ({e})") from None
    if "error" in answer:
        raise HandshakeError(f"the ring agent at {address}:{port} refused us: {answer['error']}")
    raw = str(answer.get("offer", "")).encode()
    if not hmac.compare_digest(str(answer.get("proof", "")), _mac(secret, b"agent", theirs, mine, raw)):
        raise HandshakeError(f"the peer at {address}:{port} did not prove the shared secret")
    return Offer.from_json(raw)

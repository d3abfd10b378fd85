"""Run by tests/test_nixl_link.py in a child process: two NIXL agents in this process, a target lending
a buffer (as the ring agent lends a region) and a NixlLink to it; prints one JSON line of what the
order checks saw (docs/protocol.md, "Publication order", over NIXL)."""

from __future__ import annotations

import json
import threading

import numpy as np

from blink_appliance.wire.handshake import Offer, RemoteRegion
from blink_appliance.wire.nixl_agent import apply_ucx_env, interface_of, make_agent
from blink_appliance.wire.nixl_transport import NixlLink
from blink_appliance.wire.transport import TransportLost

PAYLOAD, SECOND, WORD, N = 4096, 16384, 0, 600


def write_order(memory: np.ndarray, link: NixlLink) -> dict:
    """Payload (two spans written as one batch, one transfer) then word through the link; a reader
    thread on the target checks both spans >= word."""
    transport = link.transport("m")
    word = memory[WORD : WORD + 8].view("<u8")
    first = memory[PAYLOAD : PAYLOAD + 4096].view("<u8")
    second = memory[SECOND : SECOND + 4096].view("<u8")
    word[0] = 0
    done = threading.Event()
    violations: list[tuple[int, int]] = []
    checks = [0]

    def reader() -> None:
        while not done.is_set():
            seen = int(word[0])
            low = min(int(first.min()), int(second.min()))
            checks[0] += 1
            if low < seen:
                violations.append((seen, low))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    for i in range(1, N + 1):
        with transport.batch():
            transport.write(PAYLOAD, np.full(512, i, dtype="<u8"))
            transport.write(SECOND, np.full(512, i, dtype="<u8"))
        transport.store_u64(WORD, i)
    done.set()
    thread.join()
    low = min(int(first.min()), int(second.min()))
    return {"n": N, "final_word": int(word[0]), "final_payload_min": low,
            "checks": checks[0], "violations": violations[:5]}  # fmt: skip


def read_order(memory: np.ndarray, link: NixlLink) -> dict:
    """The target writes payload (two spans) then word; a READ of the word, then one read_many of both
    spans (one transfer), finds them >= word."""
    transport = link.transport("m")
    word = memory[WORD : WORD + 8].view("<u8")
    first = memory[PAYLOAD : PAYLOAD + 4096].view("<u8")
    second = memory[SECOND : SECOND + 4096].view("<u8")
    done = threading.Event()

    def writer() -> None:
        i = 10**6
        while not done.is_set():
            i += 1
            first[:] = i
            second[:] = i
            word[0] = i

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    violations, seen = [], 0
    try:
        for _ in range(N):
            seen = transport.load_u64(WORD)
            spans = transport.read_many([(PAYLOAD, 4096), (SECOND, 4096)])
            low = min(int(np.frombuffer(raw, dtype="<u8").min()) for raw in spans)
            if low < seen:
                violations.append((seen, low))
    finally:
        done.set()
        thread.join()
    return {"last_seen": seen, "violations": violations[:5]}


def complete_on_return(memory: np.ndarray, link: NixlLink) -> dict:
    """The rule the order rests on: when a write, a store or a batch returns, the target's memory
    already holds it (checked at once, no waiting), and a read returns what the target holds now."""
    transport = link.transport("m")
    word = memory[WORD : WORD + 8].view("<u8")
    first = memory[PAYLOAD : PAYLOAD + 4096].view("<u8")
    second = memory[SECOND : SECOND + 4096].view("<u8")
    late = {"store": 0, "write": 0, "batch": 0, "read": 0}
    for i in range(1, N + 1):
        transport.store_u64(WORD, i)
        late["store"] += int(word[0]) != i
        transport.write(PAYLOAD, np.full(512, i, dtype="<u8"))
        late["write"] += int(first.min()) != i or int(first.max()) != i
        with transport.batch():
            transport.write(PAYLOAD, np.full(512, i + 1, dtype="<u8"))
            transport.write(SECOND, np.full(512, i + 1, dtype="<u8"))
        late["batch"] += int(first.min()) != i + 1 or int(second.min()) != i + 1
        word[0] = 10 * i
        late["read"] += transport.load_u64(WORD) != 10 * i
    return {"n": N, "late": late}


def lost_link(memory: np.ndarray, link: NixlLink) -> dict:
    def outcome(call) -> str:  # noqa: ANN001
        try:
            call()
        except (ValueError, TransportLost) as e:
            return type(e).__name__
        return "nothing raised"

    transport = link.transport("m")
    result = {
        "out_of_region": outcome(lambda: transport.read(len(memory) - 4, 8)),
        "unknown_model": outcome(lambda: link.transport("other")),
    }
    link.mark_lost("test")
    result["load_after_lost"] = outcome(lambda: transport.load_u64(0))
    result["store_after_lost"] = outcome(lambda: transport.store_u64(0, 1))
    return result


def main() -> None:
    # TCP, as between two hosts: with both agents in one process UCX would otherwise pick a transport
    # that completes inside the post, and a transport that did not wait would pass unnoticed.
    apply_ucx_env({"UCX_TLS": "tcp", "UCX_NET_DEVICES": interface_of("127.0.0.1") or "lo"})
    memory = np.zeros(1 << 16, dtype=np.uint8)
    target = make_agent("probe-target", progress_thread=True)
    target.register_memory([(memory.ctypes.data, memory.nbytes, 0, "")], "DRAM")
    region = RemoteRegion("m", memory.ctypes.data, memory.nbytes)
    link = NixlLink(
        make_agent("probe-initiator", progress_thread=False),
        Offer("i", target.name, target.get_agent_metadata(), (region,)),
    )
    report = {"write_order": write_order(memory, link), "read_order": read_order(memory, link)}
    report["complete_on_return"] = complete_on_return(memory, link)
    report["lost_link"] = lost_link(memory, link)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

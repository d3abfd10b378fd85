"""bench accounting: finding the server's processes, their CPU seconds, and honest 'unavailable'."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from blink_appliance.bench.accounting import RunMeter, ServerProcesses, find_server_processes


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_listener_on_the_port_is_found_with_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            found = find_server_processes(f"http://localhost:{port}/")
        assert found.reason is None
        assert os.getpid() in found.pids and child.pid in found.pids
        assert f"listener {os.getpid()} on port {port}" in found.how
    finally:
        child.kill()
        child.wait()


def test_nothing_listening_or_another_machine_is_a_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
    nobody = find_server_processes(f"http://127.0.0.1:{port}")
    assert nobody.pids == [] and f"port {port}" in nobody.reason
    remote = find_server_processes("http://192.0.2.10:8000")  # TEST-NET-1: never this machine
    assert remote.pids == [] and "not on this machine" in remote.reason


def test_cpu_seconds_of_the_given_processes():
    meter = RunMeter(ServerProcesses([os.getpid()], "given"), gpu_index=0)
    meter.start()
    _burn(0.3)
    cost = meter.finish(output_tokens=600)
    assert 0.25 <= cost.server_cpu_s <= 1.0, cost
    assert cost.server_cpu_s_per_1k_tokens == cost.server_cpu_s / 600 * 1000
    assert cost.server_cpu_unavailable is None and cost.wall_s >= 0.25
    assert 0 < cost.machine_cpu_percent <= 100
    assert cost.client_cpu_percent > 50  # the burn ran in this process, the load generator's
    # Either an energy figure or the reason there is none (no NVML, no GPU), never both.
    assert (cost.gpu_energy_j is None) == (cost.gpu_unavailable is not None)
    assert (cost.joules_per_output_token is None) == (cost.gpu_energy_j is None)
    d = cost.to_dict()
    assert d["server_cpu_s_per_1k_tokens"] == cost.server_cpu_s_per_1k_tokens
    assert d["joules_per_output_token"] == cost.joules_per_output_token


def test_a_process_that_exits_mid_run_makes_cpu_unavailable():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    meter = RunMeter(ServerProcesses([os.getpid(), child.pid], "given"), gpu_index=None)
    meter.start()
    child.kill()
    child.wait()
    cost = meter.finish(output_tokens=10)
    assert cost.server_cpu_s is None and str(child.pid) in cost.server_cpu_unavailable
    assert cost.gpu_unavailable == "GPU energy not measured (no GPU index)"


def test_no_server_processes_keeps_the_discovery_reason():
    meter = RunMeter(ServerProcesses([], "", "the server (h) is not on this machine"))
    meter.start()
    cost = meter.finish(output_tokens=10)
    assert (
        cost.server_cpu_s is None and cost.server_cpu_unavailable == "the server (h) is not on this machine"
    )

"""`blink-appliance bench serve` end to end against a live appliance on the default CPU profile.

One appliance (SmolLM2-135M, started with tests/live_appliance.py's helpers) serves the module; runs are
a few prompts with small lengths. The bench's counts are checked against the server's own
Prometheus counters, not only against themselves.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from blink_appliance.cli import main
from tests.live_appliance import API_KEY, MODEL_NAME, start_appliance


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, smollm2_source: str):
    pytest.importorskip("blink_appliance.engine.reference.engine", reason="the CPU engine has not landed")
    app = start_appliance(tmp_path_factory.mktemp("bench-live"), smollm2_source)
    yield app
    code = app.stop()
    assert code == 0, f"appliance exited with {code}:\n{app.log()}"


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _serve(live, tmp_path, *extra: str) -> tuple[int, dict]:
    path = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", live.url, "--model", MODEL_NAME, "--api-key", API_KEY]
    argv += ["--warmup", "0", "--result-json", str(path), *extra]
    code = main(argv)
    return code, json.loads(path.read_text())


def _assert_ordered(dist: dict) -> None:
    assert dist["count"] > 0
    assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"], dist


def test_synthetic_completions_match_the_server_counters(live, tmp_path, capsys):
    gen0 = _counter(live.url, "blink_generation_tokens_total")
    prompt0 = _counter(live.url, "blink_prompt_tokens_total")
    code, doc = _serve(
        live,
        tmp_path,
        *("--num-prompts", "4", "--input-len", "12", "--output-len", "3", "--max-concurrency", "2"),
        *("--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000", "--no-gpu-energy"),
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "TTFT p99" in out and "wrote" in out
    (run,) = doc["runs"]
    m = run["metrics"]
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 4, 0)
    assert run["request_rate"] == "inf" and doc["config"]["max_concurrency"] == 2
    for r in run["requests"]:
        # The synthetic prompt has exactly the asked length, as the server counts it.
        assert r["input_len_expected"] == r["prompt_tokens"] == 12
        assert r["completion_tokens"] == r["output_tokens"] == 3 and r["usage_reported"]
        assert 1 <= r["text_chunks"] <= 3 and r["finish_reason"] == "length"
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    # The bench's totals equal what the appliance itself counted.
    assert m["total_output_tokens"] == 12 == _counter(live.url, "blink_generation_tokens_total") - gen0
    assert m["total_input_tokens"] == 48 == _counter(live.url, "blink_prompt_tokens_total") - prompt0
    assert m["output_tokens_from_usage"] and m["output_len_mismatches"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        _assert_ordered(m[key])
    assert m["request_throughput"] == pytest.approx(4 / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(12 / m["duration_s"])
    assert m["good_requests"] == 4 and m["goodput"] == pytest.approx(m["request_throughput"])
    cost = run["cost"]
    # Found from the URL: the daemon (the process the test started) and its children.
    assert live.proc.pid in cost["server_pids"] and len(cost["server_pids"]) >= 3
    assert cost["server_cpu_s"] > 0 and cost["server_cpu_s_per_1k_tokens"] > 0
    assert cost["gpu_energy_j"] is None and cost["gpu_unavailable"]


def test_random_token_prompts_at_two_rates(live, tmp_path):
    code, doc = _serve(
        live,
        tmp_path,
        *("--dataset", "random", "--tokenizer", MODEL_NAME, "--num-prompts", "2", "--input-len", "9"),
        *("--output-len", "2", "--request-rate", "4,inf", "--arrivals", "fixed", "--seed", "3"),
    )
    assert code == 0
    assert [r["request_rate"] for r in doc["runs"]] == [4.0, "inf"]
    for run in doc["runs"]:
        assert run["metrics"]["completed"] == 2 and run["metrics"]["failed"] == 0
        assert [r["prompt_tokens"] for r in run["requests"]] == [9, 9]
        assert [r["completion_tokens"] for r in run["requests"]] == [2, 2]
    fixed = doc["runs"][0]["requests"]
    assert fixed[1]["scheduled_s"] - fixed[0]["scheduled_s"] == pytest.approx(0.25, abs=0.1)


def test_chat_endpoint_under_interference(live, tmp_path):
    code, doc = _serve(
        live,
        tmp_path,
        *("--endpoint", "/v1/chat/completions", "--num-prompts", "2", "--input-len", "6-10"),
        *("--output-len", "2", "--save-detailed", "--interfere", "spin=1,syscall=1"),
    )
    assert code == 0
    (run,) = doc["runs"]
    assert run["metrics"]["completed"] == 2
    # The interference ran during the measured run and did work.
    assert doc["config"]["interference"]["spin"] == 1
    assert {w["kind"] for w in run["interference"] if w["ops"] > 0} == {"spin", "syscall"}
    for r in run["requests"]:
        assert r["completion_tokens"] == 2
        # the chat template wraps the message: the server counts more than the content's tokens
        assert r["prompt_tokens"] > r["input_len_expected"] >= 6
        assert len(r["itl_ms"]) == r["text_chunks"] - 1


def test_failing_endpoints_are_failures_not_crashes(live, tmp_path, capsys):
    common = ("--dataset", "random", "--vocab-size", "1000", "--num-prompts", "3", "--output-len", "2")
    code, doc = _serve(live, tmp_path, *common, "--input-len", "4", "--model", "no-such-model")
    assert code == 1
    m = doc["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3)
    (reason,) = m["failure_reasons"]
    assert reason.startswith("HTTP 404") and m["failure_reasons"][reason] == 3
    assert "every request failed" in capsys.readouterr().err

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    path = tmp_path / "dead.json"
    argv = ["bench", "serve", "--base-url", dead, "--model", "m", *common, "--result-json", str(path)]
    assert main(argv) == 1
    doc = json.loads(path.read_text())
    m = doc["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3)
    assert doc["warmup_failures"] and "Cannot connect" in doc["warmup_failures"][0]
    assert doc["runs"][0]["cost"]["server_cpu_unavailable"].startswith("no process")

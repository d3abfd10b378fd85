"""bench/compare: core layout, generated profiles, the targets' judgement, the report, the HF baseline,
and the whole command end to end on the CPU toy path (reference engine + HF baseline, dummy:tiny)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from bench import compare, compare_document, compare_plan, compare_report, compare_run
from bench.compare import build_parser, config_from_args
from bench.compare_plan import appliance_profile, core_layout, interference_spec, plan_systems
from bench.compare_run import Budget, SystemRecord, run_system
from blink_appliance.engine.loop.geometry import loop_geometry
from blink_appliance.engine.plan import resolve_plan
from blink_appliance.model.config import ModelConfig, RopeScaling
from blink_appliance.profile import parse_profile
from blink_appliance.profile_checks import engine_errors

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

# -- layout and profiles -----------------------------------------------------------------------


def test_core_layout_reserves_client_frontend_and_engine_on_16_cores():
    layout = core_layout(list(range(16)))
    assert (layout.client, layout.frontend, layout.engine) == ((0,), (1, 2), (3,))
    assert layout.interference == tuple(range(3, 16))  # the engine's core is shared with the load
    assert layout.baseline == (1, 2, 3)
    spec = interference_spec("auto", layout, 64)
    assert (spec.spin, spec.memory, spec.syscall, spec.memory_mib) == (13, 2, 2, 64)
    assert spec.cpus == tuple(range(3, 16))
    small = core_layout([0, 1])
    assert small.client is None and small.interference is None and "nothing pinned" in small.note
    assert interference_spec("spin=1,syscall=1", small, 8).cpus is None


def _cfg(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_gpu_profiles_size_the_loop_for_64_concurrent_requests():
    from blink_appliance.model.presets import preset_config

    cfg = _cfg("--device", "cuda:0")
    assert cfg.model == "dummy:llama-3.2-1b" and cfg.dtype == "bfloat16" and cfg.modes == ("loop", "host")
    assert cfg.max_model_len == 384 and cfg.hf_rates == (8.0,)
    assert cfg.appliance_runs.num_prompts(8.0) == 120 and cfg.appliance_runs.num_prompts(math.inf) == 256
    assert cfg.hf_runs.num_prompts(8.0) == 80 and cfg.hf_runs.request_timeout_s == 60.0
    layout = core_layout(list(range(16)))
    config = preset_config("llama-3.2-1b")
    for mode in ("loop", "host"):
        profile = parse_profile(tomllib.loads(appliance_profile(cfg, mode, layout, "blink-test")))
        assert profile.engine_mode == mode and engine_errors(profile) == []
        assert profile.model.max_seqs == 64 and profile.num_slots == 128
        assert profile.buckets == (1, 2, 4, 8, 32, 64, 128, 512)  # a decode batch of 64 has its own graph
        assert profile.frontend.max_inflight == 128 and profile.frontend.cpus == [1, 2]
        assert profile.appliance.engine_cpus == [3] and profile.frontend.port == 0
        plan = resolve_plan(profile.model, config)
        assert plan.num_kv_blocks == 64 * (384 // 16)  # the KV budget holds every sequence whole
        loop_geometry(profile, plan, config).validate()


def test_cpu_profile_is_the_reference_engine():
    cfg = _cfg("--device", "cpu")
    assert (cfg.model, cfg.dtype, cfg.modes) == ("dummy:tiny", "float32", ("reference",))
    profile = parse_profile(tomllib.loads(appliance_profile(cfg, "reference", core_layout([0, 1]), "b")))
    assert profile.engine_mode == "reference" and engine_errors(profile) == []
    assert profile.frontend.cpus == [] and profile.appliance.engine_cpus == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cpu", "--modes", "loop"], "needs a CUDA device"),
        (["--device", "cuda:0", "--modes", "reference"], "--device cpu only"),
        (["--device", "cpu", "--modes", "turbo"], "is not one of"),
        (["--device", "cpu", "--model", "tiny"], "expected a dummy: preset"),
        (["--device", "tpu"], "expected cuda:N or cpu"),
        (["--device", "cpu", "--modes", "none", "--no-hf"], "nothing to run"),
    ],
)
def test_impossible_configurations_are_refused_before_anything_starts(argv, message, capsys):
    assert compare.main(argv) == 2
    assert message in capsys.readouterr().err


def test_hf_baseline_without_transformers_is_recorded_not_run(tmp_path, monkeypatch):
    real = compare_plan.importlib.util.find_spec
    monkeypatch.setattr(
        compare_plan.importlib.util, "find_spec", lambda name: None if name == "transformers" else real(name)
    )
    cfg = _cfg("--device", "cpu", "--modes", "none", "--out-dir", str(tmp_path))
    (hf,) = plan_systems(cfg, core_layout([0, 1]), tmp_path)
    assert hf.name == "hf" and "transformers is not installed" in hf.unavailable
    rec = SystemRecord(hf)
    run_system(cfg, rec, core_layout([0, 1]), interference_spec("spin=1", core_layout([0, 1]), 8),
               Budget(100.0), tmp_path / "hf.log", lambda: None)  # fmt: skip
    assert rec.error == hf.unavailable and rec.startup_s is None
    assert [r.skipped for r in rec.runs] == [hf.unavailable] * 2


FAKE_SERVER = """
import http.server, json, signal, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "inflight": 0}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Health)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(f"http://127.0.0.1:{server.server_port}", flush=True)
for _ in range(300):  # 300 kB of stray stdout: more than a pipe holds, so only a drained pipe lets it serve
    print("x" * 1000, flush=True)
server.serve_forever()
"""


def _run_fake(tmp_path, argv, monkeypatch) -> SystemRecord:
    import sys

    cfg = _cfg("--device", "cpu", "--out-dir", str(tmp_path))
    plan = compare_plan.SystemPlan(
        "fake", "a fake server", (4.0,), cfg.appliance_runs, [sys.executable, "-c", argv]
    )
    monkeypatch.setattr(compare_run, "_warm_up", lambda *args: [])

    def measure(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(compare_run, "_measure", measure)
    rec = SystemRecord(plan)
    layout = core_layout([0, 1])
    run_system(
        cfg, rec, layout, interference_spec("spin=1", layout, 8), Budget(100.0), tmp_path / "f.log", list
    )
    return rec


def test_a_failing_run_is_recorded_and_the_server_still_stopped(tmp_path, monkeypatch):
    rec = _run_fake(tmp_path, FAKE_SERVER, monkeypatch)
    assert rec.error is None and rec.startup_s is not None and rec.exit_code == 0
    assert [r.skipped for r in rec.runs] == ["the run failed: RuntimeError: boom"] * 2
    assert "[stdout] xxx" in (tmp_path / "f.log").read_text()


def test_a_server_that_does_not_start_is_recorded_with_its_log(tmp_path, monkeypatch):
    rec = _run_fake(tmp_path, "import sys; print('no GPU here', file=sys.stderr); sys.exit(3)", monkeypatch)
    assert "fake exited with code 3 while starting" in rec.error and rec.startup_s is None
    assert "no GPU here" in rec.log_tail
    assert all(r.skipped.startswith("the server did not start") for r in rec.runs)


def test_a_budget_too_small_records_every_run_as_skipped(tmp_path, capsys):
    argv = "--device cpu --no-hf --budget-s 5 --name short --rates 2,inf".split()
    code = compare.main([*argv, "--out-dir", str(tmp_path)])
    assert code == 1  # nothing measured
    doc = json.loads((tmp_path / "short.json").read_text())
    runs = [r for s in doc["systems"] for r in s["runs"]]
    assert len(runs) == 2 * 2  # 2 rates x (isolated, colocated)
    assert all(r["result"] is None and r["skipped"].startswith("not started") for r in runs)
    md = (tmp_path / "short.md").read_text()
    assert "No plot: no run produced a P99 TPOT" in md and "skipped: not started" in md
    assert not (tmp_path / "short.png").exists()


# -- the report --------------------------------------------------------------------------------


def _result(tpot_p99: float, throughput: float, failed: int = 0) -> dict:
    dist = {
        "count": 10,
        "mean": tpot_p99 / 2,
        "p50": tpot_p99 / 2,
        "p90": tpot_p99,
        "p99": tpot_p99,
        "max": tpot_p99,
    }
    metrics = {
        "completed": 10, "failed": failed, "output_throughput": throughput, "ttft_ms": dist, "tpot_ms": dist,
        "failure_reasons": {"HTTP 503: busy": failed} if failed else {}, "output_len_mismatches": 0,
    }  # fmt: skip
    cost = {
        "joules_per_output_token": None, "server_cpu_s_per_1k_tokens": 1.5, "machine_cpu_percent": 50.0,
        "client_cpu_percent": 20.0, "gpu_unavailable": "no GPU", "server_cpu_unavailable": None,
        "server_found_by": "daemon", "server_pids": [1, 2],
    }  # fmt: skip
    return {"metrics": metrics, "cost": cost}


def _system(name: str, runs: dict[float, tuple[float, float, float]]) -> dict:
    """runs: rate -> (isolated P99 TPOT, colocated P99 TPOT, isolated tok/s)."""
    out = []
    for rate, (iso, colo, thr) in runs.items():
        r = "inf" if math.isinf(rate) else rate
        out.append(
            {"rate": r, "load": "isolated", "num_prompts": 10, "skipped": None, "result": _result(iso, thr)}
        )
        out.append(
            {"rate": r, "load": "colocated", "num_prompts": 10, "skipped": None, "result": _result(colo, thr)}
        )
    rates = ["inf" if math.isinf(r) else r for r in runs]
    return {"name": name, "label": name, "rates": rates, "startup_s": 1.0, "warmup_failures": [], "error": None,
            "log_file": f"{name}.log", "runs": out}  # fmt: skip


def _doc(*systems: dict) -> dict:
    cfg = compare_document.config_dict(_cfg("--device", "cuda:0"))
    return {
        "kind": "blink-bench-compare", "date": "2026-11-23", "elapsed_s": 100.0, "argv": [], "config": cfg,
        "machine": {"gpu": {"name": "NVIDIA H100 80GB HBM3", "driver": "580"}, "cpu_model": "x", "cpus": 16,
                    "python": "3.12", "packages": {"torch": "2.11"}},
        "layout": {"client": [0], "frontend": [1, 2], "engine": [3], "interference": list(range(3, 16)), "note": "16"},
        "interference": {"spin": 13, "memory": 2, "syscall": 2, "memory_mib": 128}, "systems": list(systems),
    }  # fmt: skip


def test_targets_met_missed_and_by_how_much():
    loop = _system("loop", {8.0: (2.0, 2.1, 1000.0), 32.0: (3.0, 3.6, 4000.0), math.inf: (5.0, 5.2, 9000.0)})
    host = _system("host", {8.0: (2.5, 2.6, 1000.0), 32.0: (3.5, 9.0, 4010.0), math.inf: (7.0, 30.0, 6000.0)})
    flat, degrades, throughput = compare_report.evaluate_targets(_doc(loop, host))
    assert flat.status == "missed" and "worst 1.20 at 32/s: 0.10 over the limit" in flat.detail
    assert degrades.status == "met" and "up to 4.29 at inf" in degrades.detail
    assert throughput.status == "met" and "inf: 1.50" in throughput.detail  # 32/s: 0.998, inside 2%

    loop = _system("loop", {8.0: (2.0, 2.1, 1000.0), math.inf: (5.0, 5.4, 5000.0)})
    host = _system("host", {8.0: (2.5, 2.7, 1000.0), math.inf: (7.0, 7.7, 6000.0)})
    flat, degrades, throughput = compare_report.evaluate_targets(_doc(loop, host))
    assert flat.status == "met" and "worst 1.08 at inf" in flat.detail
    assert degrades.status == "missed" and "at most 1.10 at inf: 0.15 short" in degrades.detail
    assert (
        throughput.status == "missed"
        and "lowest 0.83 at inf: loop mode 17% below host mode" in throughput.detail
    )

    only_loop = compare_report.evaluate_targets(_doc(loop))
    assert [t.status for t in only_loop] == ["met", "not measured", "not measured"]


def test_markdown_plot_and_rerender_from_the_json(tmp_path):
    loop = _system("loop", {8.0: (2.0, 2.1, 1000.0), math.inf: (5.0, 5.4, 5000.0)})
    host = _system("host", {8.0: (2.5, 5.0, 1000.0), math.inf: (7.0, 21.0, 6000.0)})
    host["runs"][1]["result"] = _result(5.0, 1000.0, failed=2)
    host["runs"][3] = {**host["runs"][3], "result": None, "skipped": "time budget: 20 s left"}
    doc = _doc(loop, host)
    files = compare_report.write_outputs(doc, tmp_path, "r")
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = files["md"].read_text()
    assert "| loop mode: P99 TPOT colocated / isolated <= 1.1 at every rate | **met** |" in md
    assert "| loop | 1.05 | 1.08 |" in md and "| host | 2.00 | n/a |" in md
    assert "| inf | colocated | skipped: time budget: 20 s left |" in md
    assert "8/s colocated: 2 failed; most often (2x): HTTP 503: busy" in md
    assert "![P99 TPOT and output throughput vs request rate, isolated and colocated](r.png)" in md
    (tmp_path / "again").mkdir()
    path = tmp_path / "again" / "r.json"
    path.write_text(json.dumps(doc))
    assert compare_report.main([str(path)]) == 0
    assert (tmp_path / "again" / "r.md").read_text() == md


# -- the HF baseline ---------------------------------------------------------------------------

HAVE_TRANSFORMERS = compare_plan.importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")

from bench.hf_baseline import (  # noqa: E402
    BaselineState,
    CompletionAsk,
    Job,
    StaticBatcher,
    build_hf_model,
    load_dummy_model,
    parse_completion,
)

# Small, with what llama-3.2-1b has: Llama 3 RoPE scaling, tied embeddings, GQA.
SMALL = ModelConfig(
    arch="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=500000.0, max_position_embeddings=512, tie_word_embeddings=True,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
    bos_token_id=1, eos_token_ids=(2,),
)  # fmt: skip


@needs_transformers
def test_hf_model_holds_the_same_weights_as_ours():
    from blink_appliance.model.kv_cache import PagedKVCache
    from blink_appliance.model.loaders import Checkpoint, build_model
    from blink_appliance.model.loaders.dummy import random_weights
    from tests.model_helpers import PagedSequences

    weights = random_weights(SMALL, seed=3)
    hf = build_hf_model(SMALL, weights, dtype="float32", device="cpu")
    ours = build_model(Checkpoint("small", SMALL, weights, None))
    ids = torch.randint(0, SMALL.vocab_size, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        kv = PagedKVCache.allocate(SMALL.num_layers, 8, 16, SMALL.num_kv_heads, SMALL.head_dim, torch.float32)
        got = ours(PagedSequences(8, 16, max_blocks_per_seq=8).batch([(0, ids)]), kv)[0]
    assert (got - ref[-1]).abs().max().item() < 1e-4  # position 89: past the scaled RoPE's 64


async def _tokens(job: Job) -> list[tuple[int | None, str | None]]:
    out = []
    while True:
        token, finish, error = await asyncio.wait_for(job.events.get(), 30)
        assert error is None
        out.append((token, finish))
        if finish:
            return out


@needs_transformers
async def test_static_batch_rows_equal_the_same_requests_alone():
    model, config = load_dummy_model("dummy:tiny", dtype="float32", device="cpu")
    loop = asyncio.get_running_loop()
    batcher = StaticBatcher(model, config.eos_token_ids, max_batch=4, device="cpu")
    prompts = ([5, 6, 7, 8, 9, 10, 11], [40, 41, 42])
    alone = []
    for prompt, max_tokens in zip(prompts, (3, 5), strict=True):
        job = Job(list(prompt), max_tokens, True, loop)
        await asyncio.to_thread(batcher.generate, [job])
        alone.append(await _tokens(job))
    jobs = [Job(list(p), n, True, loop) for p, n in zip(prompts, (3, 5), strict=True)]
    await asyncio.to_thread(batcher.generate, jobs)  # left-padded together, different max_tokens
    together = [await _tokens(j) for j in jobs]
    assert together == alone
    assert [len(t) for t in together] == [3, 5] and together[0][-1][1] == "length"
    # Without ignore_eos, a request ends at its first EOS (here: its own first token, made an EOS id).
    first = alone[1][0][0]
    eos_batcher = StaticBatcher(model, [first], max_batch=4, device="cpu")
    job = Job(list(prompts[1]), 5, False, loop)
    await asyncio.to_thread(eos_batcher.generate, [job])
    assert await _tokens(job) == [(first, "stop")] and job.emitted == 1


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "tiny", "prompt": "hello"}, 400, "list of token ids"),
        ({"model": "tiny", "prompt": [1, 512]}, 400, "[0, 512)"),
        ({"model": "tiny", "prompt": [1], "temperature": 0.7}, 400, "greedy only"),
        ({"model": "tiny", "prompt": [1], "temperature": 0, "top_p": 0.5}, 400, "'top_p' is not supported"),
        ({"model": "other", "prompt": [1], "temperature": 0}, 404, "does not exist"),
        ({"model": "tiny", "prompt": [1], "temperature": 0, "max_tokens": 200}, 400, "max_model_len 128"),
    ],
)
def test_the_baseline_refuses_what_it_does_not_do(body, status, fragment):
    state = BaselineState("tiny", 512, 128, batcher=None)  # type: ignore[arg-type]
    response = parse_completion(body, state)
    assert not isinstance(response, CompletionAsk)
    assert response.status == status and fragment in json.loads(response.body)["error"]["message"]
    ok = parse_completion({"model": "tiny", "prompt": [[3, 4]], "temperature": 0, "stream": True}, state)
    assert ok == CompletionAsk([3, 4], 16, True, False, False)


# -- the whole command, CPU toy path -----------------------------------------------------------


def test_compare_toy_path_end_to_end(tmp_path):
    """Reference engine and HF baseline on dummy:tiny, one rate, isolated and colocated: md, json, png."""
    argv = "--device cpu --modes reference --model dummy:tiny --rates 4 --duration 1 --hf-duration 1".split()
    argv += "--input-len 12 --output-len 6 --max-concurrency 4 --interfere spin=1,syscall=1".split()
    argv += ["--budget-s", "200", "--out-dir", str(tmp_path), "--name", "toy"]
    if not HAVE_TRANSFORMERS:
        argv.append("--no-hf")  # the appliance's part still runs; the baseline has its own tests
    assert compare.main(argv) == 0
    doc = json.loads((tmp_path / "toy.json").read_text())
    assert [s["name"] for s in doc["systems"]] == ["reference", "hf"][: 2 if HAVE_TRANSFORMERS else 1]
    for system in doc["systems"]:
        assert system["error"] is None and system["exit_code"] == 0 and system["warmup_failures"] == []
        assert [(r["rate"], r["load"]) for r in system["runs"]] == [(4.0, "isolated"), (4.0, "colocated")]
        for run in system["runs"]:
            res = run["result"]
            m, cost = res["metrics"], res["cost"]
            assert (m["completed"], m["failed"], run["num_prompts"]) == (4, 0, 4)
            # token-id prompts served as such; every request got exactly its 6 tokens
            assert [r["prompt_tokens"] for r in res["requests"]] == [12] * 4
            assert [r["completion_tokens"] for r in res["requests"]] == [6] * 4
            # Tokens that reach the front end together share a chunk: 1 to 6 chunks for 6 tokens.
            assert all(1 <= r["text_chunks"] <= 6 for r in res["requests"])
            assert m["tpot_ms"]["p99"] > 0 and m["ttft_ms"]["p99"] > 0
            assert cost["joules_per_output_token"] is None and cost["gpu_unavailable"]
            assert cost["server_cpu_s_per_1k_tokens"] > 0
        colocated = system["runs"][1]["result"]["interference"]
        assert {w["kind"] for w in colocated if w["ops"] > 0} == {"spin", "syscall"}
        assert (tmp_path / system["log_file"]).exists()
    assert "reference" in doc["systems"][0]["profile"]
    md = (tmp_path / "toy.md").read_text()
    assert "| 4/s | colocated | 4/0 |" in md and "**not measured**" in md
    assert (tmp_path / "toy.png").read_bytes()[:4] == b"\x89PNG"

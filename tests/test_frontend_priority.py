"""Priority classes from the profile through the real front-end process (issue 22): `[frontend]
api_keys` tables and `[[models]] priority` reach each model's engine as the request record's
priority, BLINK_API_KEY serves without a class, and /metrics and /telemetry report per class.
Each model's engine is a CounterEngine behind the reference ring server in a thread of this test."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from blink_appliance.profile import load_profile
from blink_appliance.wire.request import Request
from tests.ring_support import unique_name
from tests.test_frontend_models import regions_with_engines, running_front_end

BATCH, LIVE, PLAIN, ENV = "batch-key-123", "live-key-1234", "plain-key-123", "env-key-12345"


def write_profile(tmp_path: Path) -> Path:
    models = "".join(
        f'[[models]]\nname = "{name}"\nsource = "dummy:tiny"\nmax_seqs = 4\nmax_model_len = 64\n'
        f"max_num_batched_tokens = 64\nkv_budget_gib = 0.01\n{extra}\n"
        for name, extra in (("alpha", ""), ("beta", "priority = 7\n"))
    )
    path = tmp_path / "classes.toml"
    path.write_text(
        f'[appliance]\nshm_name = "{unique_name()}"\ndrain_timeout_s = 10\n\n{models}'
        '[frontend]\nport = 0\nmax_inflight = 8\napi_keys = ["plain-key-123", '
        '{ key = "batch-key-123", priority = 20 }, { key = "live-key-1234", priority = -5 }]\n'
        "\n[telemetry]\ninterval_s = 0.1\n"
    )
    return path


async def test_profile_classes_reach_the_engines_and_are_reported_per_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BLINK_API_KEY", ENV)  # the front end inherits it
    profile_path = write_profile(tmp_path)
    profile = load_profile(profile_path)
    with regions_with_engines(profile, 2) as (engines, _servers):
        seen: dict[str, list[Request]] = {name: [] for name in engines}
        for name, engine in engines.items():
            original = engine.add_request
            engine.add_request = lambda req, name=name, original=original: (  # type: ignore[method-assign]
                seen[name].append(req),
                original(req),
            )[1]
        with running_front_end(profile_path, tmp_path / "ready") as (url, _proc):
            cases = [  # (model, key, requested priority, effective priority)
                ("alpha", BATCH, None, 20),
                ("alpha", BATCH, 0, 20),  # cannot rise above its key's class
                ("alpha", LIVE, None, -5),
                ("alpha", PLAIN, None, 0),  # no class: alpha's default
                ("beta", PLAIN, None, 7),  # beta's default
                ("beta", PLAIN, 2, 7),
                ("beta", ENV, None, 7),  # BLINK_API_KEY: no class
                ("beta", ENV, 9, 9),
                ("beta", LIVE, None, -5),  # a key's class wins over the model's default
            ]
            async with aiohttp.ClientSession() as s:
                for model, key, requested, _ in cases:
                    body = {"model": model, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}
                    if requested is not None:
                        body["priority"] = requested
                    r = await s.post(
                        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                    assert r.status == 200, await r.text()
                metrics = await (await s.get(url + "/metrics")).text()
                # /telemetry serves the latest sample (every 0.1 s): wait for one after the requests.
                deadline = time.monotonic() + 10
                while True:
                    r = await s.get(url + "/telemetry", headers={"Authorization": f"Bearer {PLAIN}"})
                    snapshot = await r.json()
                    if all(len(m["classes"]) == 3 for m in snapshot["models"]):
                        break
                    assert time.monotonic() < deadline, snapshot
                    await asyncio.sleep(0.05)
    for model in ("alpha", "beta"):
        expected = [effective for m, _, _, effective in cases if m == model]
        assert [req.priority for req in seen[model]] == expected
    assert 'blink_time_to_first_token_seconds_count{model_name="alpha",priority="20"} 2.0' in metrics
    assert 'blink_time_to_first_token_seconds_count{model_name="beta",priority="7"} 3.0' in metrics
    assert 'blink_time_per_output_token_seconds_count{model_name="beta",priority="-5"} 1.0' in metrics
    classes = {m["name"]: [c["priority"] for c in m["classes"]] for m in snapshot["models"]}
    assert classes == {"alpha": [-5, 0, 20], "beta": [-5, 7, 9]}

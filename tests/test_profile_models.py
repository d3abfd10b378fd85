"""Several models in one profile (issue 21): names, per-model engine settings, sm_count, the KV
fractions of one GPU, and what each model gets: its ring region and its ring geometry."""

from __future__ import annotations

import pytest

from blink_appliance.engine.plan import resolve_plan, resolve_plans, weights_bytes
from blink_appliance.model.presets import preset_config
from blink_appliance.profile import (
    ProfileError,
    parse_profile,
    region_name,
    ring_geometry,
)

MODEL = {"source": "dummy:tiny", "kv_budget_gib": 0.01, "max_model_len": 256}


def _models(*overrides: dict, **sections: object) -> dict:
    models = [{"name": f"m{i}", **MODEL, **o} for i, o in enumerate(overrides)]
    return {"models": models, **sections}


def _error(data: dict) -> str:
    with pytest.raises(ProfileError) as e:
        parse_profile(data)
    return str(e.value)


def test_several_models_load_with_their_own_settings():
    p = parse_profile(_models({}, {"max_model_len": 512, "device": "cuda:0", "max_seqs": 8}))
    assert [m.name for m in p.models] == ["m0", "m1"]
    assert (p.engine_mode_of(0), p.engine_mode_of(1)) == ("reference", "loop")
    assert (p.uses_loop_of(0), p.uses_loop_of(1)) == (False, True)
    assert p.buckets_of(1) == (1, 2, 4, 8, 32, 128, 512) and p.num_slots_of(1) == 256


def test_one_model_view_refuses_a_profile_of_several():
    """No production path may serve models[0] alone by accident: the single-model views raise."""
    p = parse_profile(_models({}, {}))
    for view in ("model", "engine_mode", "uses_loop", "num_slots", "buckets"):
        with pytest.raises(ProfileError, match=r"has 2 models; use profile.models\[i\]"):
            getattr(p, view)
    one = parse_profile(_models({}))
    assert one.model.name == "m0" and one.engine_mode == "reference"


def test_duplicate_names_name_both_keys():
    assert "models[1].name: duplicate of models[0].name ('m')" in _error(
        _models({"name": "m"}, {"name": "m"})
    )


@pytest.mark.parametrize(
    "overrides, engine, expected",
    [
        ([{}, {"sm_count": 8}], None, "models[1].sm_count: SM partitions are for models the GPU loop"),
        ([{"device": "cuda:0", "sm_count": 8}], {"mode": "host"}, "models[0].sm_count: SM partitions"),
        ([{"device": "cuda:0"}, {"sm_count": 8}], None, "models[1].device is 'cpu'"),
        (
            [{"device": "cuda:0"}, {"device": "cuda:0", "sm_count": 0}],
            None,
            "models[1].sm_count: Input should be",
        ),
        (
            [{"device": "cuda:0"}, {"device": "cuda:0", "max_num_batched_tokens": 256}],
            {"buckets": [8, 512]},
            "engine.buckets: must end at models[1].max_num_batched_tokens (256), got [8, 512]",
        ),
        ([{}, {"device": "cuda:0"}], {"mode": "loop"}, "(models[0].device is 'cpu')"),
        ([{}, {"device": "cuda:0"}], {"mode": "reference"}, "not 'cuda:0' (models[1].device)"),
        (
            [{"device": "cuda:0"}, {"device": "cuda:0", "max_seqs": 64}],
            {"num_slots": 32},
            "engine.num_slots: (32) must be >= models[1].max_seqs (64)",
        ),
        ([{}, {"device": "cuda:0", "cpu_weights": "quantized"}], None, "models[1].cpu_weights: 'quantized'"),
    ],
)
def test_per_model_engine_errors_name_the_model(overrides, engine, expected):
    sections = {} if engine is None else {"engine": engine}
    assert expected in _error(_models(*overrides, **sections))


def test_sm_count_is_accepted_for_gpu_loop_models():
    p = parse_profile(_models({"device": "cuda:0", "sm_count": 66}, {"device": "cuda:0"}))
    assert [m.sm_count for m in p.models] == [66, None]


def test_loop_settings_are_allowed_when_any_model_runs_the_loop():
    p = parse_profile(_models({}, {"device": "cuda:0"}, engine={"num_slots": 64, "deterministic": True}))
    assert p.num_slots_of(1) == 64
    assert "engine.num_slots: only the GPU loop uses it" in _error(_models({}, {}, engine={"num_slots": 64}))


def test_kv_fractions_of_one_gpu_must_sum_to_at_most_one():
    frac = {"device": "cuda:0", "kv_budget_gib": None}
    bad = _models({**frac, "kv_fraction": 0.6}, {"device": "cuda:1"}, {**frac, "kv_fraction": 0.5})
    assert "models[0].kv_fraction + models[2].kv_fraction: 1.1 on cuda:0" in _error(bad)
    # Other devices, and the host's memory, are not shared with them.
    parse_profile(_models({**frac, "kv_fraction": 0.6}, {**frac, "device": "cuda:1", "kv_fraction": 0.6}))
    parse_profile(
        _models({"kv_budget_gib": None, "kv_fraction": 0.6}, {"kv_budget_gib": None, "kv_fraction": 0.6})
    )


def test_fractions_of_one_gpu_are_of_what_all_its_weights_leave():
    cfg = preset_config("tiny")
    frac = {"device": "cuda:0", "kv_budget_gib": None, "max_seqs": 1000, "max_num_batched_tokens": 1000}
    p = parse_profile(
        _models({**frac, "kv_fraction": 0.25}, {**frac, "kv_fraction": 0.5}, {"device": "cuda:0"})
    )
    w = weights_bytes(cfg, "float32")
    fixed = int(0.01 * 2**30)  # models[2]'s kv_budget_gib takes its share first
    available = 3 * w + fixed + 64 * 2**20
    plans = resolve_plans(p, {0: cfg, 1: cfg, 2: cfg}, available_bytes=available)
    assert plans[0].kv_budget_bytes == int(0.25 * 64 * 2**20)
    assert plans[1].kv_budget_bytes == int(0.5 * 64 * 2**20)
    assert plans[2].kv_budget_bytes == fixed
    with pytest.raises(ProfileError, match=r"models\[1\].kv_fraction: a budget of"):
        resolve_plan(p.models[1], cfg, available_bytes=3 * w, colocated_bytes=2 * w)


def test_each_model_has_its_own_region_and_ring_geometry():
    p = parse_profile(
        _models({}, {"max_model_len": 512, "max_output_tokens": 100}, appliance={"shm_name": "blink-x"})
    )
    assert [region_name(p, i) for i in range(2)] == ["blink-x", "blink-x-1"]
    assert ring_geometry(p).max_prompt_tokens == ring_geometry(p, 0).max_prompt_tokens == 255
    g = ring_geometry(p, 1)
    assert (g.max_prompt_tokens, g.max_output_tokens) == (511, 100)
    with pytest.raises(IndexError):
        region_name(p, 2)

"""The profile's tensor parallelism: the ranks' devices, the errors that name the key, the plan per rank."""

from __future__ import annotations

import pytest

from blink_appliance.engine.plan import resolve_plan
from blink_appliance.model.presets import preset_config
from blink_appliance.profile import ProfileError, parse_profile
from tests.test_profile import MINIMAL_MODEL, _error, _profile


def _tp(**model):
    gpu = {**MINIMAL_MODEL, "device": "cuda:0", "tensor_parallel": 2, **model}
    return {"models": [gpu], "engine": {"mode": "loop"}}


def test_tensor_parallel_ranks_take_devices_from_device_up_or_as_listed():
    assert parse_profile(_tp()).models[0].rank_devices == ["cuda:0", "cuda:1"]
    assert parse_profile(_tp(device="cuda:2")).models[0].rank_devices == ["cuda:2", "cuda:3"]
    listed = parse_profile(_tp(devices=["cuda:3", "cuda:1"])).models[0]
    assert (listed.device, listed.rank_devices) == ("cuda:3", ["cuda:3", "cuda:1"])
    assert parse_profile(_profile()).models[0].rank_devices == ["cpu"]


def test_tensor_parallel_errors_name_their_key():
    assert "models[0].tensor_parallel: the ranks run in the GPU loop only" in _error(
        dict(_tp(), engine={"mode": "host"})
    )
    assert "models[0].tensor_parallel: the ranks run in the GPU loop only" in _error(
        {"models": [dict(MINIMAL_MODEL, tensor_parallel=2)]}
    )
    assert "devices lists 3 devices for 2 ranks" in _error(_tp(devices=["cuda:0", "cuda:1", "cuda:2"]))
    assert "devices lists a device twice" in _error(_tp(devices=["cuda:0", "cuda:0"]))
    two_on_one = parse_profile(
        _profile(model={"replicas": 2, "devices": ["cpu", "cpu"]})
    )  # replicas may share
    assert [m.device for m in two_on_one.models] == ["cpu", "cpu"]
    assert "tensor_parallel with replicas is not built" in _error(_tp(replicas=2))
    assert "models[0].sm_count: SM partitions of tensor-parallel ranks" in _error(_tp(sm_count=60))
    other = dict(MINIMAL_MODEL, name="n", device="cuda:1")
    err = _error({"models": [_tp()["models"][0], other], "engine": {"mode": "loop"}})
    assert "models[0].tensor_parallel: its ranks' cuda:1 also hold models[1] ('n')" in err


def test_a_tensor_parallel_plan_is_per_rank():
    """Each rank holds half the heads, KV heads and MLP; embedding and LM head whole."""
    cfg = preset_config("llama-3.1-8b")
    one = resolve_plan(parse_profile(_profile(model={"kv_budget_gib": 1})).models[0], cfg)
    two = resolve_plan(parse_profile(_tp(kv_budget_gib=1)).models[0], cfg)
    assert two.bytes_per_block * 2 == one.bytes_per_block and two.num_kv_blocks == 2 * one.num_kv_blocks
    replicated = 2 * cfg.vocab_size * cfg.hidden_size * 4  # embedding + LM head, fp32
    assert two.weights_bytes - replicated == pytest.approx((one.weights_bytes - replicated) / 2, rel=1e-3)
    assert two.rank_devices == ("cuda:0", "cuda:1") and "per rank of cuda:0, cuda:1" in two.describe()
    with pytest.raises(
        ProfileError, match="models\\[0\\].tensor_parallel: tensor_parallel 2 does not divide"
    ):
        resolve_plan(parse_profile(_tp()).models[0], preset_config("smollm2-135m"))


def test_the_two_gpu_example_profile_is_one_engine_over_two_ranks():
    from pathlib import Path

    from blink_appliance.profile import load_profile

    p = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "gpu-2xh100-tp.example.toml")
    assert len(p.models) == 1 and p.model.tensor_parallel == 2 and p.engine_mode == "loop"
    assert p.model.rank_devices == ["cuda:0", "cuda:1"]


def test_check_prints_the_plan_per_rank(tmp_path, capsys):
    from blink_appliance.cli import main

    path = tmp_path / "tp.toml"
    path.write_text(
        '[[models]]\nname = "tiny"\nsource = "dummy:tiny"\ndevice = "cuda:0"\ntensor_parallel = 2\n'
        "kv_budget_gib = 0.001\nmax_model_len = 256\nmax_seqs = 4\nmax_num_batched_tokens = 64\n"
        '[engine]\nmode = "loop"\n'
    )
    assert main(["check", str(path)]) == 0
    assert "per rank of cuda:0, cuda:1" in capsys.readouterr().out

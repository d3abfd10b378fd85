"""The profile: TOML -> pydantic, errors that name the key path, refusals of what is not built, the plan."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from blink_appliance.engine.plan import GIB, resolve_plan
from blink_appliance.model.presets import preset_config
from blink_appliance.profile import ProfileError, load_profile, parse_profile, ring_geometry

REPO = Path(__file__).resolve().parents[1]
MINIMAL_MODEL = {"name": "m", "source": "dummy:tiny", "kv_budget_gib": 0.01, "max_model_len": 256}


def _profile(**sections):
    data = {"models": [dict(MINIMAL_MODEL)]}
    for key, value in sections.items():
        if key == "model":
            data["models"][0].update(value)
        else:
            data[key] = value
    return data


def _error(data) -> str:
    with pytest.raises(ProfileError) as e:
        parse_profile(data)
    return str(e.value)


def test_default_profile_loads_and_is_loopback_cpu_fp32():
    p = load_profile(REPO / "profiles" / "default.toml")
    assert p.model.name == "smollm2-135m-instruct"
    assert p.model.model_source == "smollm2-135m-instruct"
    assert (p.model.device, p.model.dtype) == ("cpu", "float32")
    assert p.frontend.host == "127.0.0.1"
    assert p.frontend.transport == "shm"


def test_gpu_example_profile_is_the_loop_on_cuda():
    p = load_profile(REPO / "profiles" / "gpu-h100.example.toml")
    assert (p.model.device, p.model.dtype, p.engine_mode) == ("cuda:0", "bfloat16", "loop")
    assert p.uses_loop and p.num_slots == 1024 and p.buckets == (1, 2, 4, 8, 32, 128, 512, 2048)


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"model": {"kv_fration": 0.5}}, "models[0].kv_fration: unknown key"),
        ({"frontend": {"prot": 1}}, "frontend.prot: unknown key"),
        ({"surprise": {}}, "surprise: unknown key"),
        ({"model": {"tensor_parallel_size": 2}}, "models[0].tensor_parallel_size: the appliance's key is"),
        ({"model": {"tensor_parallel": 4}}, "models[0].tensor_parallel: Input should be less than or equal"),
        ({"model": {"kv_budget_gib": None, "kv_fraction": 1.5}}, "models[0].kv_fraction: must be in (0, 1]"),
        ({"model": {"kv_fraction": 0.5}}, "set exactly one of kv_budget_gib and kv_fraction"),
        ({"model": {"kv_budget_gib": -1}}, "models[0].kv_budget_gib: must be > 0"),
        ({"model": {"block_size": 12}}, "models[0].block_size: must be a power of two"),
        ({"model": {"dtype": "int3"}}, "models[0].dtype"),
        ({"model": {"device": "tpu"}}, "models[0].device: 'tpu': expected 'cpu' or 'cuda:N'"),
        ({"model": {"device": "cuda"}}, "models[0].device: 'cuda': expected 'cpu' or 'cuda:N'"),
        ({"model": {"sm_count": 66}}, "models[0].sm_count: SM partitions are for models the GPU loop"),
        ({"model": {"device": "cuda:0", "sm_count": 0}}, "models[0].sm_count: Input should be greater"),
        ({"model": {"max_output_tokens": 256}}, "max_output_tokens (256) must be < max_model_len (256)"),
        ({"frontend": {"transport": "rdma"}}, "frontend.transport: 'rdma' is spelled 'nixl'"),
        ({"frontend": {"transport": "nixl"}}, "frontend.transport 'nixl' needs a [dpu] section"),
        ({"dpu": {"listen": "10.0.0.1"}}, "dpu: used only with frontend.transport = 'nixl'"),
        (
            {"frontend": {"transport": "nixl"}, "dpu": {"listen": "0.0.0.0"}},
            "dpu.listen: '0.0.0.0' listens on every interface",
        ),
        (
            {"frontend": {"transport": "nixl"}, "dpu": {"ucx_devices": ["mlx5_0:1", "a b"]}},
            "dpu.ucx_devices[1]: 'a b' is not a UCX device",
        ),
        ({"frontend": {"port": 70000}}, "frontend.port"),
        # The entry is named since keys may be tables (issue 22).
        (
            {"frontend": {"api_keys": ["short"]}},
            "frontend.api_keys[0]: each key must be at least 8 characters",
        ),
        (
            {"frontend": {"api_keys": ["secret-key-1", {"key": "secret-key-2", "priority": True}]}},
            "frontend.api_keys[1].priority: Input should be a valid integer",
        ),
        (
            {"frontend": {"api_keys": ["secret-key-1", {"key": "secret-key-2", "priority": 2**31}]}},
            "frontend.api_keys[1].priority: Input should be less than or equal to 2147483647",
        ),
        (
            {"frontend": {"api_keys": [{"key": "secret-key-2", "prio": 1}]}},
            "frontend.api_keys[0].prio: unknown key",
        ),
        (
            {"frontend": {"api_keys": [{"key": "short"}]}},
            "frontend.api_keys[0].key: each key must be at least 8",
        ),
        ({"frontend": {"api_keys": [{"priority": 1}]}}, "frontend.api_keys[0].key: required key is missing"),
        ({"frontend": {"api_keys": [7]}}, "frontend.api_keys[0]: expected a key string or a table"),
        (
            {"frontend": {"api_keys": ["secret-key-1", {"key": "secret-key-1", "priority": 3}]}},
            "frontend.api_keys: [1] repeats the key of [0]",
        ),
        ({"model": {"priority": "3"}}, "models[0].priority: Input should be a valid integer"),
        ({"model": {"priority": 1.0}}, "models[0].priority: Input should be a valid integer"),
        ({"model": {"priority": -(2**31) - 1}}, "models[0].priority: Input should be greater than or equal"),
        ({"frontend": {"transport": "nixl"}, "dpu": {"nic": "mlx5_0"}}, "dpu.nic: unknown key"),
        ({"appliance": {"shm_name": "a/b"}}, "appliance.shm_name: must be 1-200 characters"),
    ],
)
def test_errors_name_the_key_path(sections, expected):
    assert expected in _error(_profile(**sections))


def test_missing_models_and_duplicate_names():
    assert "models: required key is missing" in _error({})
    assert "models: at least one [[models]] entry is required" in _error({"models": []})
    two = {"models": [dict(MINIMAL_MODEL), dict(MINIMAL_MODEL, name="n"), dict(MINIMAL_MODEL, name="n")]}
    assert "models[2].name: duplicate of models[1].name" in _error(two)
    assert "models[0].name: required key is missing" in _error({"models": [{"kv_budget_gib": 1}]})


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[models]\nname=")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="profile not found"):
        load_profile(tmp_path / "nope.toml")


def test_overrides_are_validated():
    p = parse_profile(_profile())
    q = p.with_overrides(host="0.0.0.0", port=9001)
    assert (q.frontend.host, q.frontend.port) == ("0.0.0.0", 9001)
    assert p.frontend.port == 8000  # the original is unchanged
    with pytest.raises(ProfileError, match="frontend.port"):
        p.with_overrides(port=-5)


def test_plan_sizes_kv_from_budget():
    p = parse_profile(
        _profile(
            model={
                "source": "dummy:smollm2-135m",
                "kv_budget_gib": 0.5,
                "max_model_len": 2048,
                "max_seqs": 32,
            }
        )
    )
    plan = resolve_plan(p.model, preset_config("smollm2-135m"))
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32: 2*30*16*3*64*4 bytes per 16-token block.
    assert plan.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert plan.num_kv_blocks == int(0.5 * GIB) // plan.bytes_per_block
    assert plan.kv_bytes <= plan.kv_budget_bytes
    # 134.5M parameters (tied embeddings) in fp32
    assert 130e6 * 4 < plan.weights_bytes < 140e6 * 4
    text = plan.describe()
    assert "blocks x 16 tokens" in text and "max_seqs       32" in text


def test_plan_caps_blocks_at_what_max_seqs_can_use_and_refuses_too_small_budgets():
    cfg = preset_config("tiny")
    big = parse_profile(_profile(model={"kv_budget_gib": 8, "max_seqs": 2, "max_model_len": 256}))
    assert resolve_plan(big.model, cfg).num_kv_blocks == 2 * 256 // 16
    tiny = parse_profile(_profile(model={"kv_budget_gib": 1e-6, "max_model_len": 1024}))
    with pytest.raises(ProfileError, match=r"models\[0\].kv_budget_gib: .* fewer than one sequence"):
        resolve_plan(tiny.model, cfg)
    too_long = parse_profile(_profile(model={"max_model_len": 4096}))
    with pytest.raises(
        ProfileError, match=r"max_model_len: 4096 exceeds the model's max_position_embeddings"
    ):
        resolve_plan(too_long.model, cfg)


def test_plan_kv_fraction_is_of_memory_left_after_weights():
    cfg = preset_config("tiny")
    p = parse_profile(
        _profile(
            model={
                "kv_budget_gib": None,
                "kv_fraction": 0.5,
                "max_seqs": 1000,
                "max_num_batched_tokens": 1000,
            }
        )
    )
    plan = resolve_plan(p.model, cfg, available_bytes=plan_weights(cfg) + 10 * 2**20)
    assert plan.kv_budget_bytes == 5 * 2**20


def plan_weights(cfg) -> int:
    from blink_appliance.engine.plan import weights_bytes

    return weights_bytes(cfg, "float32")


def test_ring_geometry_follows_the_profile():
    p = parse_profile(
        _profile(model={"max_model_len": 256, "max_output_tokens": 100}, frontend={"max_inflight": 64})
    )
    g = ring_geometry(p)
    assert (g.max_inflight, g.request_slots) == (64, 64)
    assert g.max_prompt_tokens == 255 and g.max_output_tokens == 100
    assert g.arena_tokens >= g.max_prompt_tokens


def test_toml_round_trip(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text(
        textwrap.dedent(
            """
            [appliance]
            shm_name = "blink-test"
            [[models]]
            name = "tiny"
            source = "dummy:tiny"
            kv_budget_gib = 0.01
            max_model_len = 512
            [frontend]
            port = 0
            api_keys = ["secret-key-1"]
            [telemetry]
            enabled = false
            """
        )
    )
    p = load_profile(f)
    assert p.appliance.shm_name == "blink-test"
    # A string entry is a key without a priority class (issue 22: entries may be tables).
    assert p.frontend.port == 0 and p.frontend.bearer_keys == ["secret-key-1"]
    assert p.frontend.api_keys[0].priority is None and p.models[0].priority == 0
    assert p.telemetry.enabled is False


# -- the engine: reference on cpu, the GPU loop (mode "loop" or "host") on cuda -------------------


def test_engine_mode_defaults_by_device():
    cpu = parse_profile(_profile())
    assert (cpu.engine_mode, cpu.uses_loop) == ("reference", False)
    gpu = parse_profile(_profile(model={"device": "cuda:1"}))
    assert (gpu.engine_mode, gpu.uses_loop) == ("loop", True)
    host = parse_profile(_profile(model={"device": "cuda:0"}, engine={"mode": "host"}))
    assert host.engine_mode == "host" and host.uses_loop
    # The loop's kernels run on the CPU only one step per host call, under the Triton interpreter.
    assert parse_profile(_profile(engine={"mode": "host"})).engine_mode == "host"


def test_loop_capacities_default_from_the_model_and_front_end():
    p = parse_profile(
        _profile(
            model={"device": "cuda:0", "max_seqs": 64, "max_num_batched_tokens": 512},
            frontend={"max_inflight": 300},
        )
    )
    assert p.num_slots == 300 and p.buckets == (1, 2, 4, 8, 32, 128, 512)
    q = parse_profile(_profile(model={"device": "cuda:0", "max_seqs": 64, "max_num_batched_tokens": 100}))
    assert q.num_slots == 256 and q.buckets == (1, 2, 4, 8, 32, 100)  # the budget itself is the last bucket
    few = parse_profile(
        _profile(
            model={"device": "cuda:0", "max_seqs": 64, "max_num_batched_tokens": 64},
            frontend={"max_inflight": 8},
        )
    )
    assert few.num_slots == 64  # never fewer slots than one step's sequences


@pytest.mark.parametrize(
    "sections, expected",
    [
        (
            {"engine": {"mode": "loop"}},
            "engine.mode: 'loop' needs a CUDA device (models[0].device is 'cpu')",
        ),
        (
            {"model": {"device": "cuda:0"}, "engine": {"mode": "reference"}},
            "engine.mode: 'reference' (the CPU reference engine) runs on device 'cpu' only, not 'cuda:0'",
        ),
        ({"engine": {"mode": "warp"}}, "engine.mode"),
        ({"engine": {"num_slots": 8}}, "engine.num_slots: only the GPU loop uses it"),
        ({"engine": {"buckets": [8, 512]}}, "engine.buckets: only the GPU loop uses it"),
        ({"engine": {"deterministic": True}}, "engine.deterministic: only the GPU loop uses it"),
        ({"engine": {"mode": "host", "deterministic": "sometimes"}}, "engine.deterministic"),
        ({"engine": {"mode": "host", "buckets": [32, 8, 512]}}, "engine.buckets: must be distinct positive"),
        ({"engine": {"mode": "host", "buckets": [0, 512]}}, "engine.buckets: must be distinct positive"),
        ({"engine": {"mode": "host", "buckets": []}}, "engine.buckets: must be distinct positive"),
        (
            {"engine": {"mode": "host", "buckets": [8, 256]}},
            "engine.buckets: must end at models[0].max_num_batched_tokens (512), got [8, 256]",
        ),
        (
            {"model": {"device": "cuda:0"}, "engine": {"num_slots": 16}},
            "engine.num_slots: (16) must be >= models[0].max_seqs (32)",
        ),
        ({"engine": {"num_slots": 0}}, "engine.num_slots"),
        ({"engine": {"mode": "loop", "speed": 3}}, "engine.speed: unknown key"),
        (
            {"model": {"max_seqs": 64, "max_num_batched_tokens": 32}},
            "max_num_batched_tokens (32) must be >= max_seqs (64)",
        ),
    ],
)
def test_engine_errors_name_the_key_path(sections, expected):
    assert expected in _error(_profile(**sections))


def test_loop_geometry_is_the_device_state_geometry():
    from blink_appliance.engine.loop.geometry import loop_geometry

    cfg = preset_config("tiny")
    p = parse_profile(
        _profile(
            model={"device": "cuda:0", "max_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256},
            engine={"mode": "host", "num_slots": 6, "buckets": [8, 64]},
            frontend={"max_inflight": 16},
        )
    )
    plan = resolve_plan(p.model, cfg)
    g = loop_geometry(p, plan, cfg)
    assert (g.num_slots, g.max_num_seqs, g.max_num_batched_tokens, g.buckets) == (6, 4, 64, (8, 64))
    assert (g.block_size, g.num_kv_blocks, g.max_model_len) == (16, plan.num_kv_blocks, 256)
    assert g.max_stop_ids == ring_geometry(p).max_stop_ids
    assert (g.vocab_size, g.eos_token_ids) == (cfg.vocab_size, tuple(cfg.eos_token_ids))
    assert g.max_blocks_per_seq <= g.num_kv_blocks
    with pytest.raises(ProfileError, match="engine.mode: 'reference' does not run the GPU loop"):
        loop_geometry(parse_profile(_profile()), plan, cfg)


def test_kv_fraction_on_cuda_needs_that_gpu():
    import torch

    p = parse_profile(_profile(model={"device": "cuda:7", "kv_budget_gib": None, "kv_fraction": 0.5}))
    cfg = preset_config("tiny")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ProfileError, match=r"models\[0\].kv_fraction: sizing the KV cache .* needs cuda:7"):
        resolve_plan(p.model, cfg)
    # A fixed budget plans without the GPU, and an explicit reading stands in for it.
    fixed = parse_profile(_profile(model={"device": "cuda:7"}))
    assert resolve_plan(fixed.model, cfg).num_kv_blocks > 0
    assert resolve_plan(p.model, cfg, available_bytes=1 << 30).num_kv_blocks > 0


def test_api_keys_may_be_tables_with_a_priority_class_and_models_a_default(tmp_path: Path):
    """Issue 22: `[frontend] api_keys` mixes strings and {key, priority} tables; `[[models]] priority`."""
    f = tmp_path / "classes.toml"
    f.write_text(
        textwrap.dedent(
            """
            [[models]]
            name = "tiny"
            source = "dummy:tiny"
            kv_budget_gib = 0.01
            priority = 5
            [frontend]
            api_keys = ["plain-key-1", { key = "batch-key-1", priority = 10 }, { key = "live-key-1", priority = -1 }]
            """
        )
    )
    p = load_profile(f)
    assert [(k.key, k.priority) for k in p.frontend.api_keys] == [
        ("plain-key-1", None),
        ("batch-key-1", 10),
        ("live-key-1", -1),
    ]
    assert p.models[0].priority == 5
    again = p.with_overrides(port=0)  # re-validated from model_dump(): the tables survive
    assert again.frontend.api_keys == p.frontend.api_keys and again.models[0].priority == 5


def test_the_class_cap_is_off_unless_set_and_zero_pauses():
    """[engine] lower_class_limit: unset is no cap (-1 for both engines); 0 is a cap (pause)."""
    assert parse_profile(_profile()).engine.class_cap == -1
    assert parse_profile(_profile(engine={"lower_class_limit": 0})).engine.class_cap == 0
    assert parse_profile(_profile(engine={"lower_class_limit": 16})).engine.class_cap == 16
    with pytest.raises(ProfileError, match="lower_class_limit"):
        parse_profile(_profile(engine={"lower_class_limit": -1}))


def test_replicas_become_one_section_and_region_each_on_their_devices():
    """`replicas = N`: N engines of one name, each with its own region; on CUDA, one device each
    from `device` up unless `devices` says which."""
    from blink_appliance.profile import region_name

    cpu = parse_profile(_profile(model={"replicas": 2}))
    assert [(m.name, m.device, m.replica) for m in cpu.models] == [("m", "cpu", 0), ("m", "cpu", 1)]
    assert len({region_name(cpu, i) for i in range(2)}) == 2
    gpu = parse_profile(_profile(model={"replicas": 3, "device": "cuda:1"}))
    assert [m.device for m in gpu.models] == ["cuda:1", "cuda:2", "cuda:3"]
    chosen = parse_profile(
        _profile(model={"replicas": 2, "device": "cuda:0", "devices": ["cuda:4", "cuda:6"]})
    )
    assert [m.device for m in chosen.models] == ["cuda:4", "cuda:6"]
    # Overriding the address keeps the replicas as they were, not N x N of them.
    assert [m.device for m in gpu.with_overrides(port=0).models] == ["cuda:1", "cuda:2", "cuda:3"]


def test_replica_errors_name_their_key():
    assert "models[0]: devices lists 1 devices for 2 replicas" in _error(
        _profile(model={"replicas": 2, "devices": ["cpu"]})
    )
    assert "models[0].devices" in _error(_profile(model={"replicas": 1, "devices": ["gpu0"]}))
    assert "models[0].replicas" in _error(_profile(model={"replicas": 0}))
    two = {"models": [dict(MINIMAL_MODEL), dict(MINIMAL_MODEL, replicas=2)]}
    assert "models[1].name: duplicate of models[0].name" in _error(two)


def test_best_effort_turns_reach_both_engines_and_a_zero_batch_is_refused():
    """[engine] best_effort_batch / best_effort_priority: the reference's EngineConfig and the loop's
    geometry take them (unset: -1, every best-effort sequence steps); 0 would never run one."""
    from blink_appliance.engine.loop.geometry import loop_geometry
    from blink_appliance.engine.process import reference_config

    config = preset_config("tiny")
    for engine, batch, priority in (
        ({}, -1, 1),
        ({"best_effort_batch": 64, "best_effort_priority": 2}, 64, 2),
    ):
        ref = parse_profile(_profile(engine=engine))
        got = reference_config(ref, resolve_plan(ref.model, config), (2,))
        assert (got.best_effort_batch, got.best_effort_priority) == (batch, priority)
        host = parse_profile(_profile(engine={"mode": "host", **engine}))
        geo = loop_geometry(host, resolve_plan(host.model, config), config)
        assert (geo.best_effort_batch, geo.best_effort_priority) == (batch, priority)
        for engine_settings in (got, geo):  # every scheduler setting, not only these two
            assert {k: getattr(engine_settings, k) for k in ref.engine.scheduling} == ref.engine.scheduling
    assert "engine.best_effort_batch" in _error(_profile(engine={"best_effort_batch": 0}))


def test_errors_name_the_sections_as_declared_not_as_expanded_by_replicas():
    """Two replicas of models[0] come before models[1] in the expanded list; errors still say
    models[1] for the second section, and a section's error shows once, not once per replica."""
    data = {
        "models": [
            dict(MINIMAL_MODEL, name="a", device="cuda:0", replicas=2, kv_fraction=0.6, kv_budget_gib=None),
            dict(MINIMAL_MODEL, name="b", device="cuda:1", kv_fraction=0.6, kv_budget_gib=None),
        ]
    }
    assert "models[0].kv_fraction + models[1].kv_fraction: 1.2 on cuda:1" in _error(data)
    quantized = _error(_profile(model={"device": "cuda:0", "replicas": 3, "cpu_weights": "quantized"}))
    assert quantized.count("models[0].cpu_weights: 'quantized'") == 1
    p = parse_profile(
        {
            "models": [
                dict(MINIMAL_MODEL, name="a"),
                dict(MINIMAL_MODEL, name="b", device="cuda:0", replicas=2),
            ]
        }
    )
    assert [m.key("device", replica=True) for m in p.models] == [
        "models[0].device",
        "models[1].device (replica 0: cuda:0)",
        "models[1].device (replica 1: cuda:1)",
    ]

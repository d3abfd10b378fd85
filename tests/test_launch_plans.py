"""The forward's launch plans by model: wider projections split K fewer ways; the 1B plan is its sweeps'."""

from __future__ import annotations

import pytest

from blink_appliance.model.launch_plans import attention_config, decode_gemms, deterministic_gemms
from blink_appliance.model.presets import preset_config


def splits(plan) -> tuple[int, int, int]:
    return plan.qkv.split_k, plan.o.split_k, plan.down.split_k


@pytest.mark.parametrize(
    ("model", "want"), [("llama-3.2-1b", (4, 4, 8)), ("llama-3.1-8b", (2, 2, 4)), ("smollm2-135m", (4, 4, 8))]
)
def test_decode_buckets_split_k_by_the_projections_width(model, want):
    """About 192 / 128 / 128 programs a launch (bench/results/2026-11-27-h100-b1-launch-plans.md); a model
    narrower than 1B keeps 1B's splits rather than splitting K into slivers."""
    config = preset_config(model)
    for bucket in (1, 8, 16):
        plan = decode_gemms(bucket, config)
        assert splits(plan) == want
        assert plan.down.block_n == 128
        assert splits(deterministic_gemms(bucket, config)) == want


def test_without_a_model_the_plans_are_the_1b_ones():
    one_b = preset_config("llama-3.2-1b")
    for bucket in (8, 16, 32, 64, 128, 512):
        assert decode_gemms(bucket) == decode_gemms(bucket, one_b)
        assert attention_config(bucket) == attention_config(bucket, one_b)


def test_buckets_past_16_tokens_do_not_depend_on_the_model_yet():
    """Only the batch-1 buckets were measured on 8B; the others keep the 1B sweeps' shapes."""
    eight_b = preset_config("llama-3.1-8b")
    for bucket in (32, 64, 128):
        assert decode_gemms(bucket, eight_b) == decode_gemms(bucket)


@pytest.mark.parametrize(
    ("model", "rows"), [("llama-3.2-1b", 64), ("llama-3.1-8b", 128), ("smollm2-135m", 64)]
)
def test_decode_buckets_write_the_activation_from_the_gate_up_gemm(model, rows):
    """Up to 16 tokens the gate+up GEMM writes silu(gate) * up (down reads it through its plain
    pipeline, not a prologue), in tiles that give nearest 128 programs: 8192 / 64 for 1B, 14336 / 128
    (112) for 8B, not 224 (bench/results/2026-11-28-h100-gated-gate-up.md)."""
    config = preset_config(model)
    for bucket in (1, 8, 16):
        plan = decode_gemms(bucket, config)
        assert plan.silu_in_gate_up and not plan.silu_in_down
        assert plan.gate_up.block_n == rows and plan.gate_up.split_k == 1


def test_buckets_up_to_four_fuse_rope_unless_the_model_norms_q_and_k():
    """The 1- to 4-token buckets' shape (4 warps, 32-key tiles) was measured fused, and at 8 tokens
    it lost; Qwen3's q/k norms keep the RoPE kernel (gpu_forward), so Qwen3 keeps the shape measured
    with that kernel."""
    for model in ("llama-3.2-1b", "llama-3.1-8b", "smollm2-135m"):
        for bucket in (1, 2, 4):
            plan = attention_config(bucket, preset_config(model))
            assert plan.fused_rope and plan.num_warps == 4 and plan.block_n == 32
        assert not attention_config(8, preset_config(model)).fused_rope
    assert attention_config(1) == attention_config(1, preset_config("llama-3.2-1b"))
    qwen3 = preset_config("qwen3-0.6b")
    for bucket in (1, 2, 4):
        assert attention_config(bucket, qwen3) == attention_config(8, qwen3)
    assert not attention_config(1, qwen3).fused_rope


def test_small_buckets_split_keys_32_ways_where_measured_faster():
    """64-wide heads (1B) split 32 ways at 2 and 4 tokens but 16 at one (32 cost 10 µs a step in the
    loop at a short context); 128-wide heads (8B) lost at 4 tokens with 32, so only their 1-token bucket
    takes it."""
    one_b, eight_b = preset_config("llama-3.2-1b"), preset_config("llama-3.1-8b")
    assert [attention_config(t, one_b).splits for t in (1, 2, 4, 8)] == [16, 32, 32, 16]
    assert [attention_config(t, eight_b).splits for t in (1, 2, 4, 8)] == [32, 16, 16, 16]

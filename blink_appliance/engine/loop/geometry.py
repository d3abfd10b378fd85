"""The GPU loop's geometry: the fixed capacities of its state (state.py), from the profile and its plan."""

from __future__ import annotations

from blink_appliance.engine.loop.state import MAX_EOS_IDS, LoopGeometry
from blink_appliance.engine.plan import ModelPlan
from blink_appliance.model.config import ModelConfig
from blink_appliance.profile import Profile, ProfileError, ring_geometry


def loop_geometry(profile: Profile, plan: ModelPlan, config: ModelConfig) -> LoopGeometry:
    """The GPU loop's fixed capacities (engine/loop/state.py) from the profile and its plan."""
    if not profile.uses_loop:
        raise ProfileError(f"engine.mode: {profile.engine_mode!r} does not run the GPU loop")
    eos = tuple(config.eos_token_ids)
    if len(eos) > MAX_EOS_IDS:
        raise ProfileError(
            f"models[0].source: the model has {len(eos)} end-of-sequence ids; the GPU loop checks at most "
            f"{MAX_EOS_IDS}"
        )
    geometry = LoopGeometry(
        num_slots=profile.num_slots,
        max_num_seqs=plan.max_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        buckets=profile.buckets,
        block_size=plan.block_size,
        num_kv_blocks=plan.num_kv_blocks,
        max_model_len=plan.max_model_len,
        max_stop_ids=ring_geometry(profile).max_stop_ids,
        vocab_size=config.vocab_size,
        eos_token_ids=eos,
    )
    try:
        geometry.validate()  # parse_profile and resolve_plan checked each rule already, naming keys
    except ValueError as e:
        raise ProfileError(f"engine: {e}") from None
    return geometry

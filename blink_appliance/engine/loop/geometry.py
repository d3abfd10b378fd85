"""The GPU loop's geometry: the fixed capacities of its state (state.py), from the profile and its plan."""

from __future__ import annotations

from blink_appliance.engine.loop.state import MAX_EOS_IDS, LoopGeometry
from blink_appliance.engine.plan import ModelPlan
from blink_appliance.model.config import ModelConfig
from blink_appliance.profile import Profile, ProfileError, ring_geometry


def loop_geometry(profile: Profile, plan: ModelPlan, config: ModelConfig, *, index: int = 0) -> LoopGeometry:
    """The GPU loop's fixed capacities (engine/loop/state.py) for models[index], from the profile and its plan."""
    if not profile.uses_loop_of(index):
        raise ProfileError(f"engine.mode: {profile.engine_mode_of(index)!r} does not run the GPU loop")
    eos = tuple(config.eos_token_ids)
    if len(eos) > MAX_EOS_IDS:
        raise ProfileError(
            f"{profile.models[index].key('source')}: the model has {len(eos)} end-of-sequence ids; the GPU loop checks at most "
            f"{MAX_EOS_IDS}"
        )
    geometry = LoopGeometry(
        num_slots=profile.num_slots_of(index),
        max_num_seqs=plan.max_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        buckets=profile.buckets_of(index),
        block_size=plan.block_size,
        num_kv_blocks=plan.num_kv_blocks,
        max_model_len=plan.max_model_len,
        max_stop_ids=ring_geometry(profile, index).max_stop_ids,
        max_logit_bias=ring_geometry(profile, index).max_logit_bias,
        vocab_size=config.vocab_size,
        eos_token_ids=eos,
        **profile.engine.scheduling,
        constraint_words=ring_geometry(profile, index).constraint_words,
    )
    try:
        geometry.validate()  # parse_profile and resolve_plan checked each rule already, naming keys
    except ValueError as e:
        raise ProfileError(f"engine: {e}") from None
    return geometry

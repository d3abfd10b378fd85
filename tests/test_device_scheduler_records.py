"""The schedule step's ring intake against the CPU reference (tests/scheduler_twin.py): rejected,
duplicate, unaddressable and cancelled records, shutdown, more records than free slots."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.loop.state import COUNTER_INDEX, LoopGeometry, SlotState  # noqa: E402
from blink_appliance.wire.request import FinishReason, SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import FINISH_CODES, ErrorCode  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.twin_front_end import LOOP, RING, prompt  # noqa: E402

BAD_RECORDS: list[tuple[str, dict[str, object], list[int] | None]] = [
    ("prompt_len 0", {"prompt_len": 0}, None),
    ("prompt_len over max_prompt_tokens", {"prompt_len": RING.max_prompt_tokens + 1}, None),
    ("token out of vocab", {}, [5, 6, 512, 7]),
    ("negative token", {}, [5, -1]),
    ("n_stop too large", {"n_stop": RING.max_stop_ids + 1}, None),
    ("stop id out of vocab", {"n_stop": 1, "stop_ids": [600, 0, 0, 0]}, None),
    ("max_tokens 0", {"max_tokens": 0}, None),
    ("max_tokens over the channel", {"max_tokens": RING.max_output_tokens + 1}, None),
    ("prompt below arena_tail", {"prompt_offset": 0, "arena_end": 4}, None),  # space already released
    ("has_seed 2", {"has_seed": 2}, None),
    ("ignore_eos 3", {"ignore_eos": 3}, None),
    ("temperature nan", {"temperature": float("nan")}, None),
    ("temperature negative", {"temperature": -0.5}, None),
    ("top_p 0", {"top_p": 0.0}, None),
    ("top_p inf", {"top_p": float("inf")}, None),
    ("top_k negative", {"top_k": -2}, None),
    ("min_p above 1", {"min_p": 1.5}, None),
    ("seed beyond 2**63", {"has_seed": 1, "seed": 2**63 + 5}, None),
    ("logprobs over 20", {"logprobs": 22}, None),
    ("prompt_logprobs 2", {"logprobs": 2, "prompt_logprobs": 2}, None),
    ("logprob rows outside the area", {"logprobs": 3, "lp_offset": RING.logprob_pairs - 2}, None),
    ("presence_penalty 3", {"presence_penalty": 3.0}, None),
    ("frequency_penalty nan", {"frequency_penalty": float("nan")}, None),
    ("repetition_penalty negative", {"repetition_penalty": -1.0}, None),
    ("n_bias over the record's room", {"n_bias": RING.max_logit_bias + 1}, None),
    ("logit_bias id out of vocab", {"n_bias": 2, "bias_ids": [5] + [600] * (RING.max_logit_bias - 1)}, None),
    ("logit_bias value 101", {"n_bias": 1, "bias_values": [101.0] * RING.max_logit_bias}, None),
    ("longer than max_model_len", {}, prompt(LOOP.max_model_len + 1, 9)),
    # Last of its group: releasing the arena up to a bogus arena_end releases everything published
    # (clamped to arena_head), so records behind it in the same ring pass fail the arena check too.
    ("arena_end inconsistent", {"arena_end": 10**6}, None),
]


def test_rejected_records_get_engine_servers_error_codes():
    t = Twin()
    for i in range(0, len(BAD_RECORDS), 5):  # a few per iteration: each takes a slot until commit
        for _, fields, tokens in BAD_RECORDS[i : i + 5]:
            t.front.submit(tokens or prompt(4, i), record=fields)
        t.step()
    codes = [code for _, reason, code in t.stats.finishes if reason == FINISH_CODES[FinishReason.ERROR]]
    assert len(codes) == len(BAD_RECORDS)
    assert set(codes) == {
        ErrorCode.PROMPT_LENGTH, ErrorCode.BAD_RECORD, ErrorCode.TOKEN_OUT_OF_VOCAB, ErrorCode.STOP_IDS,
        ErrorCode.MAX_TOKENS, ErrorCode.INVALID_PARAMS, ErrorCode.ENGINE_REJECTED,
    }  # fmt: skip
    assert int(t.state.counters[COUNTER_INDEX["requests_rejected"]]) == len(BAD_RECORDS)
    # The loop keeps serving after all that.
    t.front.submit(prompt(6, 1), SamplingParams(temperature=0.0, max_tokens=3))
    t.run_until_idle()


def test_duplicates_unaddressable_records_and_cancel_before_admission():
    t = Twin()
    live = t.front.submit(prompt(6, 1), SamplingParams(temperature=0.0, max_tokens=8))
    t.step()
    t.front.submit(prompt(3, 2), request_id=live.request_id)  # same id as a live request: BAD_RECORD
    t.front.submit(prompt(3, 3), record={"slot": RING.max_inflight + 3})  # no such channel: skipped
    t.front.submit(prompt(3, 4), record={"generation": 0})  # not the channel's generation: skipped
    doomed = t.front.submit(prompt(3, 5))
    t.front.cancel(doomed)  # cancelled before the engine read the record: ABORT, never admitted
    t.step()
    assert int(t.state.counters[COUNTER_INDEX["records_unaddressable"]]) == 2
    assert t.stats.last_finish(doomed.channel) == (FINISH_CODES[FinishReason.ABORT], 0)
    # A bad prompt frees its id: the same id right after is admitted (engine_server never held it).
    bad = t.front.submit([1, 1000], request_id=500)
    t.step()
    assert t.stats.last_finish(bad.channel) == (
        FINISH_CODES[FinishReason.ERROR],
        ErrorCode.TOKEN_OUT_OF_VOCAB,
    )
    t.front.submit(prompt(3, 6), request_id=500)
    t.step()
    assert 500 in [q.request_id for q in t.engine.scheduler.running]
    t.front.cancel(live)
    t.run_until_idle()


def test_shutdown_finishes_everything_and_returns_every_block():
    t = Twin()
    for i in range(RING.max_inflight - 1):  # one channel left for a record queued after shutdown
        t.front.submit(prompt(9, i), SamplingParams(temperature=0.0, max_tokens=10))
    for _ in range(4):
        t.step()
    assert int(t.state.free_top) < LOOP.num_kv_blocks
    t.front.shutdown()
    tail = t.dev_region.load("req_tail")
    queued = t.front.submit(prompt(3, 9))  # after the shutdown word: left in the ring for the host
    t.launch()
    s = t.state
    live = [i for i in range(LOOP.num_slots) if int(s.slot_state[i]) != SlotState.FREE]
    assert live and all(int(s.slot_state[i]) == SlotState.FINISHING for i in live)
    assert {(int(s.finish_reason[i]), int(s.error_code[i])) for i in live} == {
        (FINISH_CODES[FinishReason.ABORT], ErrorCode.SHUTDOWN)
    }
    assert int(s.free_top) == LOOP.num_kv_blocks and sorted(s.free_blocks.tolist()) == list(range(10))
    assert (s.block_table == -1).all() and (s.num_blocks == 0).all()
    assert int(s.shutdown_seen) == 1 and int(s.step_num_tokens) == 0
    assert int(s.bucket_index) == len(LOOP.buckets) and (s.sample_slot == -1).all()
    assert t.dev_region.load("req_tail") == tail and t.dev_region.record_seq(tail) == tail + 1
    assert queued.channel not in [int(s.chan[i]) for i in live]
    # The reference aborts the same requests.
    ref, _ = t._reference_iteration()
    finished_dev = t._device_commit([])
    shut = {
        c for c in range(RING.max_inflight) if t.ref_region.read_status(c)["error_code"] == ErrorCode.SHUTDOWN
    }
    assert set(finished_dev) == shut - {queued.channel}


def test_records_beyond_free_slots_wait_in_the_ring():
    loop = LoopGeometry(
        num_slots=4, max_num_seqs=2, max_num_batched_tokens=8, buckets=(8,), block_size=4, num_kv_blocks=32,
        max_model_len=32, max_stop_ids=4, vocab_size=512, eos_token_ids=(2,),
    )  # fmt: skip
    t = Twin(loop, check_slot_is_channel=False)
    for i in range(6):
        t.front.submit(prompt(3, i))
    t.launch()
    assert t.dev_region.load("req_tail") == 4  # one record per free slot
    assert int(t.state.counters[COUNTER_INDEX["requests_admitted"]]) == 4
    assert int(t.state.num_active) == 4
    t._free(0)
    t._free(3)
    t.launch()
    assert t.dev_region.load("req_tail") == 6
    assert sorted(t.state.request_id.tolist()) == [2, 3, 5, 6]


def test_a_new_schedule_program_starts_at_the_tails_the_ring_has():
    """req_tail and arena_tail are the schedule program's own words, kept on the device between
    launches: a scheduler built over a ring another one consumed from (an engine restart) starts where
    that one stopped, neither taking old records again nor missing new ones."""
    from blink_appliance.engine.loop.scheduler import DeviceScheduler
    from blink_appliance.engine.loop.state import DeviceState
    from blink_appliance.model.step_inputs import StepInputs
    from tests.scheduler_twin import DEVICE, ENGINE_SEED

    t = Twin(check_slot_is_channel=False)
    for i in range(3):
        t.front.submit(prompt(4, i))
    t.launch()
    assert t.dev_region.load("req_tail") == 3 and t.dev_region.load("arena_tail") > 0
    state = DeviceState.allocate(t.loop, DEVICE)
    inputs = StepInputs.allocate(
        t.loop.max_num_batched_tokens, t.loop.max_num_seqs, t.loop.max_blocks_per_seq, DEVICE,
        t.loop.prompt_score_chunk,
    )  # fmt: skip
    restarted = DeviceScheduler(t.loop, state, t.ring, t.layout, inputs, ENGINE_SEED)
    arena_tail = t.dev_region.load("arena_tail")
    queued = t.front.submit(prompt(6, 9), request_id=777)
    restarted.launch()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert t.dev_region.load("req_tail") == 4
    assert t.dev_region.load("arena_tail") > arena_tail
    assert int(state.num_active) == 1
    assert [
        int(r) for r, s in zip(state.request_id, state.slot_state, strict=True) if s != SlotState.FREE
    ] == [777]
    assert queued.channel in state.chan.tolist()


def test_logprob_requests_are_admitted_with_their_rows_and_pick_the_logprob_sampler():
    t = Twin()
    asking = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2)
    t.front.submit(prompt(5, 1), asking, record={"lp_offset": 0})
    t.front.submit(prompt(4, 2), SamplingParams(temperature=0.7, seed=1, max_tokens=3))
    t.front.submit(prompt(6, 3), asking, record={"lp_offset": 9})
    t.run_until_idle()  # the twin compares lp_top_n and sampler_index (SAMPLER_LOGPROBS) each step
    codes = [code for _, _, code in t.stats.finishes]
    assert codes == [0, 0, 0] and t.stats.steps > 0


def test_penalized_requests_carry_their_penalties_and_biases_into_their_slots():
    t = Twin()
    bias = tuple((5 * i + 3, float(i) - 40.5) for i in range(80))  # more than one tile of entries
    t.front.submit(prompt(5, 1), SamplingParams(temperature=0.0, max_tokens=3, logit_bias=bias))
    t.front.submit(prompt(4, 2), SamplingParams(temperature=0.0, max_tokens=3))
    t.front.submit(prompt(6, 3), SamplingParams(temperature=0.8, seed=2, max_tokens=3, presence_penalty=0.5,
                                                frequency_penalty=-0.25, repetition_penalty=1.3))  # fmt: skip
    t.run_until_idle()  # the twin compares each slot's fields and the sampler index each step
    assert [code for _, _, code in t.stats.finishes] == [0, 0, 0]


def test_a_request_admitted_beside_running_ones_keeps_every_part_of_the_sampler_index():
    """Rows already running (greedy, with logprobs and a penalty) and a row admitted this step (top-k
    sampling) need the top-k variant with logprobs after the penalties: 2 + 4 + 8 (SAMPLER_*)."""
    t = Twin()
    t.front.submit(prompt(5, 1), SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, presence_penalty=0.5),
                   record={"lp_offset": 0})  # fmt: skip
    t.step()
    t.step()  # decoding now
    t.front.submit(prompt(4, 2), SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=2))
    t.run_until_idle()  # the twin checks sampler_index against the rows of every step


def test_a_record_whose_automaton_does_not_parse_is_refused():
    """Seven zero words are no automaton (no states): invalid_params, as the reference says."""
    t = Twin()
    t.front.submit(prompt(5, 1), SamplingParams(temperature=0.0, max_tokens=3), record={"constraint_len": 7})
    t.front.submit(prompt(4, 2), SamplingParams(temperature=0.0, max_tokens=3))
    t.run_until_idle()
    assert [code for _, _, code in t.stats.finishes] == [ErrorCode.INVALID_PARAMS, 0]

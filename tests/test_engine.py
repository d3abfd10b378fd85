"""LLMEngine end to end on a tiny random fp32 model: batching invariance, preemption, aborts, stops,
validation."""

from __future__ import annotations

import functools

import pytest
import torch

from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
from blink_appliance.model.loaders import build_model, load_checkpoint
from blink_appliance.wire.request import FinishReason, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@functools.cache
def tiny_model():
    return build_model(load_checkpoint("dummy:tiny", seed=0), torch.float32, "cpu")


def engine(**overrides) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    cfg.update(overrides)
    return LLMEngine(tiny_model(), EngineConfig(seed=0, **cfg))


def prompt(rid: int, length: int) -> list[int]:
    return [(rid * 37 + i * 11) % 500 + 3 for i in range(length)]


LENGTHS = [1, 5, 17, 30, 9, 44, 3, 23]


def requests(params: SamplingParams = GREEDY) -> list[Request]:
    return [Request(i, prompt(i, n), params) for i, n in enumerate(LENGTHS)]


@functools.cache
def alone(params: SamplingParams = GREEDY) -> dict[int, list[int]]:
    out = {}
    for r in requests(params):
        out.update(engine().generate([r]))
    return out


def run_events(e: LLMEngine) -> list:
    events = []
    while e.has_unfinished():
        events.extend(e.step())
    return events


def test_concurrent_greedy_equals_each_request_alone():
    e = engine()
    got = e.generate(requests())
    assert got == alone()
    assert all(len(v) == GREEDY.max_tokens for v in got.values())
    assert e.stats().preemptions == 0 and e.stats().kv_blocks_used == 0


def test_chunked_prefill_and_small_batches_do_not_change_greedy_output():
    e = engine(max_num_batched_tokens=8, max_num_seqs=3)
    assert e.generate(requests()) == alone()


def test_preemption_under_a_tiny_kv_budget_keeps_greedy_output():
    # 64 slots (the minimum for max_model_len 64): the eight requests need ~180 at their peak.
    e = engine(num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=32)
    got = e.generate(requests())
    assert e.stats().preemptions > 0
    assert got == alone()
    assert e.stats().kv_blocks_used == 0


def test_seeded_sampling_is_independent_of_batching_and_preemption():
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=10, ignore_eos=True)
    ref = alone(params)
    assert engine().generate(requests(params)) == ref
    e = engine(num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=32)
    assert e.generate(requests(params)) == ref
    assert e.stats().preemptions > 0
    assert len({tuple(v) for v in ref.values()}) == len(ref)


def test_unseeded_requests_get_different_seeds():
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    out = engine().generate([Request(0, [5, 6, 7], params), Request(1, [5, 6, 7], params)])
    assert out[0] != out[1]


def test_one_terminal_event_per_request_and_timestamps_in_order():
    e = engine(max_num_batched_tokens=16)
    for r in requests():
        e.add_request(r)
    events = run_events(e)
    terminal = [ev.request_id for ev in events if ev.finished]
    assert sorted(terminal) == list(range(len(LENGTHS)))
    stamps = [ev.timestamp_ns for ev in events]
    assert stamps == sorted(stamps) and stamps[0] > 0
    for rid in range(len(LENGTHS)):
        mine = [ev for ev in events if ev.request_id == rid]
        assert mine[-1].finished and not any(ev.finished for ev in mine[:-1])
        assert mine[-1].finish_reason is FinishReason.LENGTH and mine[-1].token_id is not None
    assert e.stats().generated_tokens == len(events)


def test_abort_mid_generation_frees_blocks_at_once():
    e = engine()
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    e.add_request(Request(1, prompt(1, 30), long))
    e.add_request(Request(2, prompt(2, 10), long))
    for _ in range(3):
        e.step()
    used = e.stats().kv_blocks_used
    assert used > 0
    e.abort(1)
    assert e.stats().kv_blocks_used == used - 8  # 30 prompt + 2 decoded tokens computed, blocks of 4
    events = e.step()
    aborts = [ev for ev in events if ev.request_id == 1]
    assert len(aborts) == 1 and aborts[0].finish_reason is FinishReason.ABORT and aborts[0].token_id is None
    assert [ev.request_id for ev in events if ev.request_id == 2] == [2]
    e.abort(1)  # finished: no-op
    e.abort(999)  # unknown: no-op
    e.abort(2)
    assert e.stats().kv_blocks_used == 0
    assert [(ev.request_id, ev.finish_reason) for ev in e.step()] == [(2, FinishReason.ABORT)]
    assert not e.has_unfinished()
    assert e.step() == []


def test_abort_a_waiting_request():
    e = engine(max_num_seqs=1)
    e.add_request(Request(1, [5, 6], GREEDY))
    e.add_request(Request(2, [5, 6], GREEDY))
    e.step()
    assert e.stats().waiting == 1
    e.abort(2)
    assert e.stats().waiting == 0
    events = run_events(e)
    assert [ev.request_id for ev in events if ev.finished] == [2, 1]


def test_aborted_id_is_busy_until_its_event_is_out():
    e = engine()
    e.add_request(Request(1, [5, 6], GREEDY))
    e.abort(1)
    with pytest.raises(ValueError, match="request_id 1"):
        e.add_request(Request(1, [5, 6], GREEDY))
    e.step()
    e.add_request(Request(1, [5, 6], GREEDY))  # free again


def test_stop_tokens_eos_and_ignore_eos():
    base = alone()[5]
    stop = base[4]
    first = base.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,))
    e = engine()
    e.add_request(Request(5, prompt(5, LENGTHS[5]), params))
    events = run_events(e)
    assert [ev.token_id for ev in events] == base[: first + 1]
    assert events[-1].finish_reason is FinishReason.STOP

    e = engine(eos_token_ids=(stop,))
    e.add_request(Request(5, prompt(5, LENGTHS[5]), SamplingParams(temperature=0.0, max_tokens=12)))
    events = run_events(e)
    assert [ev.token_id for ev in events] == base[: first + 1]
    assert events[-1].finish_reason is FinishReason.STOP
    e = engine(eos_token_ids=(stop,))
    assert e.generate([Request(5, prompt(5, LENGTHS[5]), GREEDY)])[5] == base  # ignore_eos


def test_max_tokens_and_max_model_len_end_with_length():
    e = engine(max_model_len=40, num_kv_blocks=10)
    e.add_request(Request(1, prompt(1, 35), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
    e.add_request(Request(2, prompt(2, 40), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
    e.add_request(Request(3, prompt(3, 3), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    events = run_events(e)
    counts = {rid: sum(1 for ev in events if ev.request_id == rid) for rid in (1, 2, 3)}
    assert counts == {1: 5, 2: 1, 3: 2}  # up to max_model_len tokens in all; a full prompt still samples one
    assert all(ev.finish_reason is FinishReason.LENGTH for ev in events if ev.finished)


def test_priority_decides_who_runs_first():
    e = engine(max_num_seqs=1)
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    e.add_request(Request(1, [5], p, priority=5))
    e.add_request(Request(2, [6], p, priority=0))
    e.add_request(Request(3, [7], p, priority=5))
    done = [ev.request_id for ev in run_events(e) if ev.finished]
    assert done == [2, 1, 3]


@pytest.mark.parametrize(
    "req,field",
    [
        (Request(1, [], GREEDY), "prompt_token_ids is empty"),
        (Request(1, [3] * 257, GREEDY), "max_model_len"),
        (Request(1, [3, 512], GREEDY), "outside the vocabulary"),
        (Request(1, [3, -1], GREEDY), "outside the vocabulary"),
        (Request(1, [3], SamplingParams(temperature=-1.0)), "temperature"),
        (Request(1, [3], SamplingParams(top_p=0.0)), "top_p"),
        (Request(1, [3], SamplingParams(max_tokens=0)), "max_tokens"),
        (Request(1, [3], SamplingParams(stop_token_ids=(9999,))), "stop_token_ids"),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(req, field):
    e = engine()
    with pytest.raises(ValueError, match=field):
        e.add_request(req)
    assert not e.has_unfinished()


def test_duplicate_request_id_is_refused():
    e = engine()
    e.add_request(Request(1, [3], GREEDY))
    with pytest.raises(ValueError, match="request_id 1"):
        e.add_request(Request(1, [4], GREEDY))


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(max_num_seqs=100, max_num_batched_tokens=64), "max_num_batched_tokens"),
        (dict(num_kv_blocks=10, max_model_len=256), "num_kv_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(max_model_len=4096, num_kv_blocks=1024), "max_position_embeddings"),
    ],
)
def test_bad_engine_configs_are_refused(overrides, field):
    with pytest.raises(ValueError, match=field):
        engine(**overrides)


def test_generate_is_all_or_nothing_and_needs_an_idle_engine():
    e = engine()
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        e.generate([Request(1, [3], GREEDY), Request(2, [], GREEDY)])
    assert not e.has_unfinished() and e.stats().kv_blocks_used == 0
    e.add_request(Request(3, [3], GREEDY))
    with pytest.raises(RuntimeError, match="idle engine"):
        e.generate([Request(4, [3], GREEDY)])

"""Malformed request records (what a buggy or hostile front end could publish) against the reference
engine's ring server: each gets its error code on its own channel, or is counted when it has none
to answer on, and the server keeps serving."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.ring_layout import FINAL_BIT, ErrorCode, RingLayout
from tests.ring_support import (
    SMALL,
    VOCAB,
    CounterEngine,
    RawProducer,
    expected_events,
    server_thread,
    shm_region,
)

RECORD_BYTES = RingLayout.of(SMALL).request.itemsize

MUTATIONS = [
    ({"prompt_len": 0}, ErrorCode.PROMPT_LENGTH),
    ({"prompt_len": SMALL.max_prompt_tokens + 1}, ErrorCode.PROMPT_LENGTH),
    ({"prompt_offset": 10**9}, ErrorCode.BAD_RECORD),
    ({"arena_end": 10**9}, ErrorCode.BAD_RECORD),
    ({"n_stop": SMALL.max_stop_ids + 1}, ErrorCode.STOP_IDS),
    ({"n_stop": 1, "stop_ids": [VOCAB, 0, 0, 0]}, ErrorCode.STOP_IDS),
    ({"max_tokens": 0}, ErrorCode.MAX_TOKENS),
    ({"max_tokens": SMALL.max_output_tokens + 1}, ErrorCode.MAX_TOKENS),
    ({"temperature": -1.0}, ErrorCode.INVALID_PARAMS),
    ({"temperature": float("nan")}, ErrorCode.INVALID_PARAMS),
    ({"top_p": float("inf")}, ErrorCode.INVALID_PARAMS),
    ({"top_p": 0.0}, ErrorCode.INVALID_PARAMS),
    ({"top_k": -2}, ErrorCode.INVALID_PARAMS),
    ({"min_p": 1.5}, ErrorCode.INVALID_PARAMS),
    ({"has_seed": 3}, ErrorCode.INVALID_PARAMS),
    ({"has_seed": 1, "seed": 2**63 + 1}, ErrorCode.INVALID_PARAMS),
    ({"ignore_eos": 7}, ErrorCode.INVALID_PARAMS),
    ({"logprobs": 22}, ErrorCode.INVALID_PARAMS),  # 21 alternatives: one over the limit
    ({"prompt_logprobs": 1}, ErrorCode.INVALID_PARAMS),  # without logprobs
    ({"logprobs": 3, "prompt_logprobs": 2}, ErrorCode.INVALID_PARAMS),
    ({"logprobs": 3, "lp_offset": SMALL.logprob_pairs - 5}, ErrorCode.BAD_RECORD),  # rows past the area
]


@pytest.fixture(scope="module")
def serving_region():
    engine = CounterEngine()
    with shm_region() as transport, server_thread(engine, transport, frontend_timeout_s=600) as server:
        yield RawProducer(server.region), server


def wait_done(region: RingRegion, slot: int, generation: int, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while region.load_progress(slot, "done") != generation:
        assert time.monotonic() < deadline, "engine did not finish the record"
        time.sleep(0.0005)
    return region.read_status(slot), region.load_progress(slot, "count") & ~FINAL_BIT


def check_still_serving(producer: RawProducer):
    slot, gen = producer.publish([11, 12])
    status, count = wait_done(producer.region, slot, gen)
    assert int(status["error_code"]) == ErrorCode.NONE and count == 4
    tokens, _ = producer.region.read_output(slot, 0, 4)
    assert tokens.tolist() == expected_events([11, 12], 4)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    mutation=st.sampled_from(MUTATIONS),
    prompt=st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=32),
)
def test_malformed_record_gets_its_error_code_and_engine_keeps_serving(serving_region, mutation, prompt):
    producer, _server = serving_region
    overrides, code = mutation
    slot, gen = producer.publish(prompt, overrides=overrides)
    status, count = wait_done(producer.region, slot, gen)
    assert int(status["error_code"]) == code, bytes(status["error_detail"])
    assert int(status["finish_reason"]) == 4 and count == 0
    check_still_serving(producer)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    bad_token=st.one_of(st.integers(VOCAB, 2**31 - 1), st.integers(-(2**31), -1)),
    where=st.integers(0, 15),
)
def test_prompt_token_outside_vocab_is_rejected(serving_region, bad_token, where):
    producer, _server = serving_region
    prompt = [5] * 16
    prompt[where] = bad_token
    slot, gen = producer.publish(prompt)
    status, _ = wait_done(producer.region, slot, gen)
    assert int(status["error_code"]) == ErrorCode.TOKEN_OUT_OF_VOCAB
    assert f"position {where}" in bytes(status["error_detail"]).decode()
    check_still_serving(producer)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(min_size=RECORD_BYTES - 8, max_size=RECORD_BYTES - 8), addressable=st.booleans())
def test_random_record_bytes_never_stop_the_engine(serving_region, payload, addressable):
    producer, server = serving_region
    record = np.frombuffer(bytes(8) + payload, dtype=producer.region.layout.request)[0]
    overrides = {name: record[name] for name in record.dtype.names if name != "seq"}
    before = server._counters["records_unaddressable"]
    slot = producer.next_slot % SMALL.max_inflight
    if addressable:
        overrides["slot"] = slot
        overrides["generation"] = producer.region.load_ctl(slot, "generation") + 1
    slot_written, gen = producer.publish([1, 2, 3], overrides=overrides)
    if addressable:
        status, _ = wait_done(producer.region, slot_written, gen)
        assert int(status["finish_reason"]) in (2, 4)  # LENGTH (it happened to be valid) or ERROR
        if int(status["finish_reason"]) == 4:
            assert int(status["error_code"]) != ErrorCode.NONE
    else:
        deadline = time.monotonic() + 5
        while server._tail < producer.head:
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        claimed = int(record["slot"]) == slot_written and int(record["generation"]) == gen
        if not claimed:
            assert server._counters["records_unaddressable"] == before + 1
    check_still_serving(producer)

"""The GPU loop's state: every tensor the device-resident scheduler, sampler and commit read and write.

This module is the one definition of that state (the loop's counterpart of ring_layout.py). It is
allocated once at boot on the loop's device and never resized; the kernels of one loop iteration
(docs/device_loop.md) pass it along in this order:

    wait (CUDA C: idle backoff) -> schedule (Triton) -> SWITCH bucket -> forward graph
        -> sample (torch, static shapes) -> commit (Triton) -> set WHILE condition (CUDA C)

Ownership, so that no kernel reaches around another:
- schedule reads the ring's input side (records, arena, cancel words, shutdown), writes req_tail /
  arena_tail, owns sequence slots and KV blocks, and writes the step's forward inputs
  (GpuForward.inputs), the step tables and the per-row sampling tensors below.
- sample reads the forward's logits and the per-row sampling tensors, writes `sampled`.
- commit reads `sampled` and the step tables, appends tokens, writes the ring's output side
  (tokens, times, progress, status), releases finished slots and their blocks, updates telemetry,
  and writes `keep_running` (the WHILE condition).
Terminal events are published by commit only: schedule marks a slot FINISHING with a finish code
(cancel, rejected record, shutdown) and commit publishes it in the same iteration.

Slot life cycle (one slot per admitted request; `num_slots` can exceed the per-step batch):

    FREE --admit--> WAITING --scheduled--> RUNNING --stop/length--> FINISHING --commit--> FREE
                       ^                      |
                       +---- preempt ---------+      cancel / reject / shutdown: any -> FINISHING

A WAITING slot holds no KV blocks and feeds its tokens from position 0 when scheduled (a fresh
prompt, or recompute after preemption: its generated tokens are kept and fed again like prompt).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

from blink_appliance.wire.prefix_hash import cache_table_size
from blink_appliance.wire.request import MAX_LOGIT_BIAS
from blink_appliance.wire.ring_layout import ENGINE_COUNTER_FIELDS, STEP_TIME_FIELDS


class SlotState(enum.IntEnum):
    FREE = 0
    WAITING = 1  # admitted, holds no blocks
    RUNNING = 2  # holds blocks for its num_computed tokens
    FINISHING = 3  # finish_reason/error_code set; commit publishes the terminal event this iteration


MAX_EOS_IDS = 8  # end-of-sequence ids the loop checks (model config's, padded with -1)


@dataclass(frozen=True)
class LoopGeometry:
    """Fixed capacities of the loop; from the profile, checked once at boot."""

    num_slots: int  # D: admitted requests the device tracks at once (running or waiting)
    max_num_seqs: int  # S: sequences in one step (GpuForward.max_seqs)
    max_num_batched_tokens: int  # token budget per step; equals the largest bucket
    buckets: tuple[int, ...]  # captured forward sizes, ascending
    block_size: int
    num_kv_blocks: int
    max_model_len: int  # prompt + generated tokens of one sequence
    max_stop_ids: int  # = RingGeometry.max_stop_ids
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # at most MAX_EOS_IDS
    priority_aging_steps: int = 0  # a waiting slot gains one priority level per this many steps; 0: off
    lower_class_limit: int = -1  # lower-class running slots that run beside the top class; -1: no cap
    best_effort_batch: int = -1  # best-effort running slots that step at once, taking turns; -1: all
    best_effort_priority: int = 1  # classes at or past this one are best effort
    max_logit_bias: int = MAX_LOGIT_BIAS  # = RingGeometry.max_logit_bias
    prefix_cache: bool = False  # admissions reuse cached prompt blocks (the ring carries block hashes)
    prompt_score_chunk: int = 512  # P: prompt positions scored per step at most (SchedulerConfig's)
    constraint_words: int = 1 << 22  # = RingGeometry.constraint_words: the device copy of the constraint area

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def lru_capacity(self) -> int:
        """Entries of the LRU ring: live ones (at most every block) plus dead ones, compacted once
        they pass half of it (kernels/prefix_cache.py)."""
        return 4 * self.num_kv_blocks

    def validate(self) -> None:
        if list(self.buckets) != sorted(set(self.buckets)) or not self.buckets or self.buckets[0] < 1:
            raise ValueError(
                f"buckets must be distinct positive sizes in ascending order, got {self.buckets}"
            )
        if self.max_num_batched_tokens != self.buckets[-1]:
            raise ValueError("max_num_batched_tokens must equal the largest bucket")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs (one token per decoding sequence)"
            )
        if self.num_slots < self.max_num_seqs:
            raise ValueError("num_slots must be >= max_num_seqs")
        if self.num_kv_blocks < self.max_blocks_per_seq:
            raise ValueError("num_kv_blocks cannot hold one sequence of max_model_len")
        if self.priority_aging_steps < 0:
            raise ValueError("priority_aging_steps must be >= 0")
        if self.lower_class_limit < -1:
            raise ValueError("lower_class_limit must be >= -1")
        if self.best_effort_batch == 0 or self.best_effort_batch < -1:
            raise ValueError("best_effort_batch must be >= 1 or -1")
        if self.prompt_score_chunk < 1:
            raise ValueError("prompt_score_chunk must be >= 1")
        if len(self.eos_token_ids) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} eos token ids")


@dataclass
class DeviceState:
    """All loop state, int32 unless noted. [D] = per slot, [S] = per batch sequence / sample row."""

    # -- per slot [D] ---------------------------------------------------------------------------
    slot_state: torch.Tensor  # SlotState
    chan: torch.Tensor  # output channel (ring slot) of the request
    generation: torch.Tensor  # int64: the channel generation the request owns
    request_id: torch.Tensor  # int64
    priority: torch.Tensor  # lower runs first
    arrival: torch.Tensor  # int64: admission counter, FCFS within a priority class
    run_order: torch.Tensor  # int64: when it last became RUNNING (admission counter)
    run_priority: torch.Tensor  # its effective priority when last admitted: its class while RUNNING;
    #                             running order is (run_priority, run_order), the last is the next victim
    wait_since: torch.Tensor  # int64: the step clock (counters' `steps`) when it last became WAITING
    prompt_len: torch.Tensor
    num_tokens: torch.Tensor  # prompt + generated
    num_computed: torch.Tensor  # tokens whose K/V are in the cache after this step (0 while WAITING);
    #                             schedule advances it by the chunk it schedules, commit never does
    max_tokens: torch.Tensor
    temperature: torch.Tensor  # float32; 0 = greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor
    min_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64 in [0, 2**63): the record's seed, or one derived at admission
    ignore_eos: torch.Tensor
    n_stop: torch.Tensor
    stop_ids: torch.Tensor  # [D, max_stop_ids]
    token_ids: torch.Tensor  # [D, max_model_len]: prompt, then generated tokens
    block_table: torch.Tensor  # [D, max_blocks_per_seq], -1 beyond num_blocks
    num_blocks: torch.Tensor
    finish_reason: torch.Tensor  # FINISH_CODES (ring_layout) once FINISHING, else 0
    error_code: torch.Tensor  # ErrorCode (ring_layout)
    lp_top_n: torch.Tensor  # logprob alternatives the request asked for; -1: no logprobs
    lp_offset: torch.Tensor  # int64: the first pair of its output tokens' rows in the logprob area
    lp_next: torch.Tensor  # the next prompt position to score (prompt logprobs); prompt_len: none left
    c_offset: torch.Tensor  # int64: its automaton's first word in constraint_arena; -1: unconstrained
    c_state: torch.Tensor  # its automaton's state after its generated tokens
    penalized: torch.Tensor  # 1: a penalty or a logit bias changes its logits (engine/loop/penalties.py)
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    repetition_penalty: torch.Tensor  # float32; 1 = off
    n_bias: torch.Tensor
    bias_ids: torch.Tensor  # [D, max_logit_bias]
    bias_values: torch.Tensor  # [D, max_logit_bias] float32

    # -- KV blocks: the free stack, holders, the prefix cache (kernels/prefix_cache.py) ---------------
    free_blocks: torch.Tensor  # [num_kv_blocks]; entries [0, free_top) are empty block ids
    free_top: torch.Tensor  # [1]
    block_ref: torch.Tensor  # [num_kv_blocks]: slots whose tables hold the block
    block_cached: torch.Tensor  # [num_kv_blocks]: 1 while registered in cache_table
    block_key: torch.Tensor  # [num_kv_blocks * 4]: the hash words it is registered under
    cache_table: torch.Tensor  # [cache_table_size(num_kv_blocks)]: block, -1 empty; by the hash's low bits
    lru: torch.Tensor  # [lru_capacity]: cached blocks nobody holds, least recently released first
    lru_pos: torch.Tensor  # [num_kv_blocks] int64: the absolute LRU position of the block's latest entry
    lru_words: torch.Tensor  # [3] int64: LRU head, tail (absolute positions), live entries
    evicted: torch.Tensor  # [num_kv_blocks]: schedule's scratch, the blocks one allocation evicts
    n_hashes: torch.Tensor  # [D]: block hashes of the slot's prompt (0: looks nothing up)
    prefix_hash: torch.Tensor  # [D, max_blocks_per_seq * 4] with the cache, else [1, 4]: those hashes
    # [max(constraint_words, 1)]: the automata of constrained slots, copied from the ring's constraint
    # area at admission to the same offsets (wire/automaton.py; kernels/constraint.py reads them)
    constraint_arena: torch.Tensor

    # -- this step, written by schedule -----------------------------------------------------------
    step_slot: torch.Tensor  # [S]: slot of batch sequence s, -1 unused (GpuForward.inputs order)
    step_chunk: torch.Tensor  # [S]: tokens fed for it this step
    sample_slot: torch.Tensor  # [S]: slot whose token logits row r holds, -1 unused
    step_num_tokens: torch.Tensor  # [1]: tokens in the step (0: no forward this iteration)
    bucket_index: torch.Tensor  # [1]: SWITCH value; len(buckets) = run no forward
    sampler_index: torch.Tensor  # [1]: SWITCH value for the sampler (kernels/sampling.py SAMPLER_*)
    num_sample_rows: torch.Tensor  # [1]: sample rows in use, [0, n) of the row tensors: the sampler's work
    # per sample row [S], gathered from the slots so the sampler reads rows directly
    row_temperature: torch.Tensor  # float32
    row_top_k: torch.Tensor  # int64
    row_top_p: torch.Tensor  # float32
    row_min_p: torch.Tensor  # float32
    row_seed: torch.Tensor  # int64
    row_output_index: torch.Tensor  # int64: tokens the row's request generated before this one
    # the prompt positions this step scores [P] (one sequence's: Scheduler phase 6), rows [0, n)
    num_score_rows: torch.Tensor  # [1]
    score_slot: torch.Tensor  # the scoring slot, -1 unused
    score_token: torch.Tensor  # int64: the prompt token at the scored position
    score_index: torch.Tensor  # int64: its logprob row relative to the first output token's (p - prompt_len)
    score_temperature: torch.Tensor  # float32

    # -- written by sample, read by commit ----------------------------------------------------------
    sampled: torch.Tensor  # [S] int64: token of sample row r

    # -- loop control and counters ----------------------------------------------------------------
    num_active: torch.Tensor  # [1]: slots not FREE (the wait kernel spins only when 0 and the ring is empty)
    shutdown_seen: torch.Tensor  # [1]: schedule saw the ring's shutdown word, marked all slots FINISHING
    keep_running: torch.Tensor  # [1]: WHILE condition; commit writes 0 once shutdown_seen
    next_arrival: torch.Tensor  # [1] int64
    next_run_order: torch.Tensor  # [1] int64
    clock_offset_ns: torch.Tensor  # [1] int64: host monotonic ns minus device clock ns, set at boot
    counters: torch.Tensor  # [len(COUNTERS)] int64, see COUNTERS
    step_start_ns: torch.Tensor  # [1] int64: schedule's clock at the start of this iteration
    step_time_hist: torch.Tensor  # [len(STEP_TIME_FIELDS)] int64: steps per time bucket (ring_layout)

    @classmethod
    def allocate(cls, g: LoopGeometry, device: torch.device | str) -> DeviceState:
        g.validate()
        D, S, P = g.num_slots, g.max_num_seqs, g.prompt_score_chunk

        def i32(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int32, device=device)

        def i64(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        def f32(*shape: int, fill: float = 0.0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.float32, device=device)

        return cls(
            slot_state=i32(D), chan=i32(D, fill=-1), generation=i64(D), request_id=i64(D),
            priority=i32(D), arrival=i64(D), run_order=i64(D),
            run_priority=i32(D), wait_since=i64(D), prompt_len=i32(D), num_tokens=i32(D), num_computed=i32(D),
            max_tokens=i32(D), temperature=f32(D), top_p=f32(D, fill=1.0), top_k=i32(D), min_p=f32(D),
            seed=i64(D), ignore_eos=i32(D), n_stop=i32(D), stop_ids=i32(D, g.max_stop_ids, fill=-1),
            token_ids=i32(D, g.max_model_len), block_table=i32(D, g.max_blocks_per_seq, fill=-1),
            num_blocks=i32(D), finish_reason=i32(D), error_code=i32(D), lp_top_n=i32(D, fill=-1), lp_offset=i64(D), lp_next=i32(D),
            c_offset=i64(D, fill=-1), c_state=i32(D), constraint_arena=i32(max(g.constraint_words, 1)),
            penalized=i32(D), presence_penalty=f32(D), frequency_penalty=f32(D), repetition_penalty=f32(D, fill=1.0),
            n_bias=i32(D), bias_ids=i32(D, max(g.max_logit_bias, 1)), bias_values=f32(D, max(g.max_logit_bias, 1)),
            # Popping from the top hands out low block ids first, like the reference allocator.
            free_blocks=torch.arange(g.num_kv_blocks - 1, -1, -1, dtype=torch.int32, device=device),
            free_top=i32(1, fill=g.num_kv_blocks),
            block_ref=i32(g.num_kv_blocks), block_cached=i32(g.num_kv_blocks), block_key=i32(4 * g.num_kv_blocks),
            cache_table=i32(cache_table_size(g.num_kv_blocks), fill=-1), lru=i32(g.lru_capacity),
            lru_pos=i64(g.num_kv_blocks, fill=-1), lru_words=i64(3), evicted=i32(g.num_kv_blocks),
            n_hashes=i32(D), prefix_hash=i32(D, 4 * g.max_blocks_per_seq) if g.prefix_cache else i32(1, 4),
            step_slot=i32(S, fill=-1), step_chunk=i32(S), sample_slot=i32(S, fill=-1),
            step_num_tokens=i32(1), bucket_index=i32(1, fill=len(g.buckets)), sampler_index=i32(1),
            num_sample_rows=i32(1),
            row_temperature=f32(S), row_top_k=i64(S), row_top_p=f32(S, fill=1.0), row_min_p=f32(S),
            row_seed=i64(S), row_output_index=i64(S),
            num_score_rows=i32(1), score_slot=i32(P, fill=-1), score_token=i64(P), score_index=i64(P),
            score_temperature=f32(P),
            sampled=i64(S),
            num_active=i32(1), shutdown_seen=i32(1), keep_running=i32(1, fill=1), next_arrival=i64(1),
            next_run_order=i64(1), clock_offset_ns=i64(1),
            counters=i64(len(COUNTERS)), step_start_ns=i64(1), step_time_hist=i64(len(STEP_TIME_FIELDS)),
        )  # fmt: skip

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def lru_order(self) -> list[int]:
        """The cached blocks nobody holds, least recently released first (a sync; for tests)."""
        head, tail, _ = self.lru_words.cpu().tolist()
        lru, pos = self.lru.cpu(), self.lru_pos.cpu()
        ref, cached = self.block_ref.cpu(), self.block_cached.cpu()
        order = []
        for p in range(head, tail):
            b = int(lru[p % lru.numel()])
            if ref[b] == 0 and cached[b] and pos[b] == p:
                order.append(b)
        return order

    def problems(self) -> list[str]:
        """What is wrong with the loop's bookkeeping, read back to the host (a sync): every block is
        held (its holder count the tables that hold it), or on the free stack [0, free_top), or a live
        LRU entry, exactly once; cached blocks and the cache table agree; a FREE or WAITING slot holds
        none, and RUNNING slots have distinct run orders (the schedule ranks them by (run_priority,
        run_order)). Empty when consistent; for tests and stress checks between iterations, never on
        the token path."""
        n = self.free_blocks.numel()
        top = int(self.free_top[0])
        if not 0 <= top <= n:
            return [f"free_top {top} outside [0, {n}]"]
        held, states, tables = self.num_blocks.cpu(), self.slot_state.cpu(), self.block_table.cpu()
        problems = []
        holders = [0] * n
        for s in range(held.numel()):
            k = int(held[s])
            if k and states[s] in (SlotState.FREE, SlotState.WAITING):
                problems.append(f"slot {s} is {SlotState(int(states[s])).name} but holds {k} blocks")
            for b in tables[s, :k].tolist():
                holders[b] += 1
            if (tables[s, k:] != -1).any():
                problems.append(f"slot {s} has table entries past its {k} blocks")
        running = states == SlotState.RUNNING
        orders = self.run_order.cpu()[running].tolist()
        if len(set(orders)) != len(orders):
            twice = sorted({o for o in orders if orders.count(o) > 1})[:8]
            problems.append(f"RUNNING slots share run orders, e.g. {twice}")
        if holders != self.block_ref.cpu().tolist():
            wrong = [b for b, h in enumerate(holders) if h != int(self.block_ref[b])][:8]
            problems.append(f"holder counts differ from the tables, e.g. blocks {wrong}")
        lru = self.lru_order()
        if len(lru) != int(self.lru_words[2]):
            problems.append(f"{len(lru)} live LRU entries, the count word says {int(self.lru_words[2])}")
        ids = self.free_blocks[:top].cpu().tolist() + lru + [b for b, h in enumerate(holders) if h]
        if sorted(ids) != list(range(n)):
            seen: dict[int, int] = {}
            for b in ids:
                seen[b] = seen.get(b, 0) + 1
            twice = sorted(b for b, c in seen.items() if c > 1)[:8]
            missing = len(set(range(n)) - set(ids))
            problems.append(
                f"{len(ids)} block ids held, free or cached for {n} blocks: {missing} missing, twice e.g. {twice}"
            )
        return problems + self._cache_problems()

    def _cache_problems(self) -> list[str]:
        """The cache table names exactly the cached blocks, each at its hash's entry."""
        table, cached, key = self.cache_table.cpu(), self.block_cached.cpu(), self.block_key.cpu()
        named = {int(b) for b in table.tolist() if b >= 0}
        flagged = {b for b in range(cached.numel()) if cached[b]}
        problems = [] if named == flagged else [f"cache table names {sorted(named ^ flagged)[:8]} wrongly"]
        for b in flagged:
            if table[int(key[4 * b]) & (table.numel() - 1)] != b:
                problems.append(f"cached block {b} is not at its hash's table entry")
                break
        return problems


# Loop counters (DeviceState.counters), cumulative but for last_step_ns (schedule start to commit of
# the latest iteration that ran a forward): the wire's engine counters, which the host copies into the
# ring's telemetry words without touching the token path, then the loop's own (no telemetry word):
# step_tokens (the sum of step_num_tokens) and steady_steps (steps that took the steady decode path,
# kernels/schedule_steady.py). loop_iterations leads: bench/loop_stress.py reads the first counters by
# position.
COUNTERS: tuple[str, ...] = (
    "loop_iterations",
    *(name for name in ENGINE_COUNTER_FIELDS if name != "loop_iterations"),
    "step_tokens",
    "steady_steps",
)
COUNTER_INDEX = {name: i for i, name in enumerate(COUNTERS)}

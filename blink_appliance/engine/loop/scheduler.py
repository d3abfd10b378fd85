"""DeviceScheduler: the GPU loop's schedule step (kernels/schedule.py) bound to its tensors once.

Built at boot from the loop's geometry and state, the mapped ring region and the forward's static
inputs; `launch()` then enqueues one program on the current stream. Everything it needs is bound at
construction (pointers, sizes, the bucket table, a scratch buffer), so a launch does no host sync, no
allocation and nothing that depends on host-visible values: it can be captured in a CUDA graph and
replayed by the device loop. docs/device_loop.md ("schedule") says what one launch does.
"""

from __future__ import annotations

import os
import time

import torch
import triton

from blink_appliance.engine.loop import kernel_args
from blink_appliance.engine.loop.state import COUNTERS, DeviceState, LoopGeometry
from blink_appliance.kernels.ring_access import snap_tails_index
from blink_appliance.kernels.schedule import schedule_kernel
from blink_appliance.model.step_inputs import StepInputs
from blink_appliance.wire.ring_layout import RingLayout

# The schedule's phases as kernels/schedule.py stamps them (`stamp_phases`), each named by what ends it.
PHASE_NAMES = (
    "ring words",
    "cancels",
    "records",
    "order running",
    "holds, scoring",
    "budget fill",
    "admission",
    "running batch",
    "score rows, registration",
    "step tables",
    "forward inputs",
    "counters",
)
PHASES = len(PHASE_NAMES)
RECORDS_PER_LAUNCH = 16  # request records one launch admits at most (more wait for the next one)
PROMPT_TILE = 1024  # prompt tokens copied per load of the ring's arena
TOKEN_TILE = 64  # forward rows written per tile
BLOCK_TILE = 4  # KV blocks moved per slot per tile (pushes and pops)
RANK_TILE = 32  # running sequences compared per tile when they are put in run order
TABLE_ROW_TILE = 16  # block-table rows of the forward's inputs written per tile
BIAS_TILE = 64  # logit_bias entries copied per load
LRU_TILE = 64  # LRU entries read per pass when evicting or compacting (kernels/prefix_cache.py)
HASH_TILE = 32  # prompt block hashes looked up or registered per pass

# The DeviceState and StepInputs tensors schedule_kernel takes, each as `<name>_ptr`.
_STATE_TENSORS = (
    "slot_state", "chan", "generation", "request_id", "priority", "arrival", "run_order", "run_priority",
    "wait_since", "prompt_len",
    "num_tokens", "num_computed", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "ignore_eos", "n_stop", "stop_ids", "token_ids", "block_table", "num_blocks", "finish_reason",
    "error_code", "lp_top_n", "lp_offset", "lp_next", "c_offset", "c_state", "constraint_arena", "penalized", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "n_bias", "bias_ids", "bias_values", "free_blocks", "free_top", "block_ref",
    "block_cached", "block_key", "cache_table", "lru", "lru_pos", "lru_words", "evicted", "n_hashes",
    "prefix_hash", "step_slot", "step_chunk", "sample_slot", "step_num_tokens",
    "bucket_index", "sampler_index", "num_sample_rows", "row_temperature", "row_top_k", "row_top_p", "row_min_p", "row_seed",
    "row_output_index", "num_score_rows", "score_slot", "score_token", "score_index", "score_temperature",
    "num_active", "shutdown_seen", "next_arrival", "next_run_order", "counters",
    "step_start_ns", "clock_offset_ns",
)  # fmt: skip
_INPUT_TENSORS = (
    "input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_tables", "sample_rows", "score_rows",
)  # fmt: skip


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def schedule_warps(num_slots: int) -> int:
    """Warps of the one schedule program: more threads share the slot-wide vectors as num_slots grows,
    while few slots pay only the barriers (H100, bench/results/2026-11-26-h100-schedule-warps.json)."""
    return 4 if num_slots <= 256 else 8 if num_slots <= 2048 else 16


class DeviceScheduler:
    """The schedule step of the device loop; `launch()` is what the loop's graph captures.

    `steady=False` builds the program without the steady decode step (kernels/schedule_steady.py), so
    every step takes the full path: the differential test's other side."""

    def __init__(
        self,
        geometry: LoopGeometry,
        state: DeviceState,
        ring: torch.Tensor,
        layout: RingLayout,
        inputs: StepInputs,
        engine_seed: int,
        *,
        num_warps: int | None = None,
        rank_tile: int = RANK_TILE,
        table_row_tile: int = TABLE_ROW_TILE,
        steady: bool = True,
    ) -> None:
        geometry.validate()
        g, rg = geometry, layout.geometry
        device = state.slot_state.device
        self._check(g, state, ring, layout, inputs, engine_seed, device)
        self.geometry = geometry
        self.num_warps = num_warps or schedule_warps(g.num_slots)
        self.buckets = torch.tensor(g.buckets, dtype=torch.int32, device=device)
        block_d, block_s = _pow2(g.num_slots), _pow2(g.max_num_seqs)
        # [0, block_d): running slots compacted; [block_d, +block_s): the same in run order;
        # [block_d + block_s], [+1]: block-table columns and rows the last forward step wrote (the
        # first writes all); [+2]: whether this step is a steady one (kernels/schedule_steady.py).
        words = block_d + block_s
        self.scratch = torch.zeros(words + 3, dtype=torch.int32, device=device)
        self.scratch[words] = g.max_blocks_per_seq
        self.scratch[words + 1] = g.max_num_seqs
        block_r = min(RECORDS_PER_LAUNCH, block_d)
        # The ring words the front end may change mid-launch, one value for every thread (schedule.py).
        # Its last two words are req_tail and arena_tail, which only the kernel writes while it runs
        # (ring_access.snap_tails): they start as the ring has them.
        tails = snap_tails_index(block_r, block_d)
        self.snap = torch.zeros(tails + 2, dtype=torch.int64, device=device)
        for i, word in enumerate(("req_tail", "arena_tail")):
            at = layout.control(word)
            self.snap[tails + i] = ring[at : at + 8].view(torch.int64)[0]
        self.host_clock_ns = torch.zeros(1, dtype=torch.int64, device=device)  # the interpreter's clock
        # Cycle stamps of the schedule's phases (`stamp_phases`; 62 and 63: the first and last in ns).
        self.stamps = torch.zeros(64, dtype=torch.int64, device=device)
        # Each record's logit_bias, copied out of the ring once, checked and then moved into its slot.
        bias = max(rg.max_logit_bias, 1)
        self.bias_stage_ids = torch.zeros(block_r * bias, dtype=torch.int32, device=device)
        self.bias_stage_values = torch.zeros(block_r * bias, dtype=torch.float32, device=device)
        # The kernel's arguments by parameter name (a tensor `<name>` as `<name>_ptr`), each
        # parameter given once (kernel_args.check_parameters below).
        self._args = {f"{name}_ptr": getattr(state, name) for name in _STATE_TENSORS}
        self._args |= {f"{name}_ptr": getattr(inputs, name) for name in _INPUT_TENSORS}
        self._args |= dict(
            ring_ptr=ring, buckets_ptr=self.buckets, scratch_ptr=self.scratch, snap_ptr=self.snap,
            host_clock_ns_ptr=self.host_clock_ns, engine_seed=engine_seed, stamps_ptr=self.stamps,
            bias_stage_ids_ptr=self.bias_stage_ids, bias_stage_values_ptr=self.bias_stage_values,
        )  # fmt: skip
        record = kernel_args.request_fields(layout)  # raises if a field is not where or what the kernel reads
        # Inline PTX (acquire/release on the ring, the clock) only where the kernel is compiled for a GPU.
        on_gpu = device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
        self._constants = dict(
            D=g.num_slots, S=g.max_num_seqs, MAX_BATCHED=g.max_num_batched_tokens,
            NUM_BUCKETS=len(g.buckets), BS=g.block_size, MAXB=g.max_blocks_per_seq,
            MAX_MODEL_LEN=g.max_model_len, VOCAB=g.vocab_size, NUM_COUNTERS=len(COUNTERS),
            AGING=g.priority_aging_steps, LIMIT=g.lower_class_limit, SCORE=g.prompt_score_chunk,
            BE_BATCH=g.best_effort_batch, BE_PRI=g.best_effort_priority,
            REQ_SLOTS=rg.request_slots, ARENA_TOKENS=rg.arena_tokens, MAX_PROMPT=rg.max_prompt_tokens,
            MAX_INFLIGHT=rg.max_inflight, MAX_OUTPUT=rg.max_output_tokens, MAX_STOP=rg.max_stop_ids,
            AREAS=kernel_args.record_areas(layout), MAX_BIAS=max(rg.max_logit_bias, 1), BIAS_TILE=BIAS_TILE,
            PBS=rg.prefix_block_size, C=state.cache_table.numel(), Q=g.lru_capacity,
            HSTRIDE=state.prefix_hash.shape[1] if g.prefix_cache else 0, BLOCK_L=LRU_TILE, BLOCK_HASH=HASH_TILE,
            OFF_RECORDS=layout.records, REC_BYTES=layout.request.itemsize, OFF_ARENA=layout.arena,
            OFF_CTL=layout.chan_ctl, OFF_PROG=layout.chan_prog,
            BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_S1=_pow2(g.max_num_seqs + 1),
            BLOCK_R=block_r, BLOCK_STOP=_pow2(rg.max_stop_ids),
            BLOCK_J=BLOCK_TILE, BLOCK_P=min(PROMPT_TILE, _pow2(rg.max_prompt_tokens)),
            BLOCK_T=min(TOKEN_TILE, _pow2(g.max_num_batched_tokens)), BLOCK_C=min(64, _pow2(g.max_blocks_per_seq)),
            BLOCK_ROWS=min(_pow2(table_row_tile), block_s),
            BLOCK_NB=_pow2(len(g.buckets)), BLOCK_NC=_pow2(len(COUNTERS)), BLOCK_RANK=min(_pow2(rank_tile), block_s),
            BLOCK_SCORE=_pow2(g.prompt_score_chunk),
            SLOT=kernel_args.SLOT_STATES, FINISH=kernel_args.FINISH_REASONS, ERROR=kernel_args.ERROR_CODES,
            COUNTER=kernel_args.SCHEDULE_COUNTERS, CONTROL=kernel_args.CONTROL_WORDS, RECORD=record,
            CHANNEL=kernel_args.CHANNEL_LAYOUT,
            ON_GPU=on_gpu, STAMPS=False, STEADY=steady,
        )  # fmt: skip
        kernel_args.check_parameters(schedule_kernel, self._args, self._constants)
        # The step's start stamp: the device clock on the GPU; the host's, written here, when interpreted.
        self._stamp_host_clock = (lambda: None) if on_gpu else self._stamp_host_clock_now

    def _stamp_host_clock_now(self) -> None:
        self.host_clock_ns.fill_(time.monotonic_ns())

    @staticmethod
    def _check(
        g: LoopGeometry,
        state: DeviceState,
        ring: torch.Tensor,
        layout: RingLayout,
        inputs: StepInputs,
        engine_seed: int,
        device: torch.device,
    ) -> None:
        rg = layout.geometry
        if not 0 <= engine_seed < 2**63:
            raise ValueError(f"engine_seed must be in [0, 2**63), got {engine_seed}")
        if ring.dtype != torch.uint8 or ring.dim() != 1 or ring.numel() < layout.size:
            raise ValueError(
                f"ring must be a flat uint8 tensor over the whole region ({layout.size} bytes), "
                f"got {ring.dtype} {tuple(ring.shape)}"
            )
        if ring.device != device:
            raise ValueError(f"ring is on {ring.device}, the loop state on {device} (map the region there)")
        if rg.max_logit_bias != g.max_logit_bias:
            raise ValueError(
                f"ring max_logit_bias ({rg.max_logit_bias}) differs from the loop's ({g.max_logit_bias})"
            )
        want = g.block_size if g.prefix_cache else 0
        if rg.prefix_block_size != want:
            raise ValueError(
                f"ring prefix_block_size is {rg.prefix_block_size}, the loop needs {want} (its block size "
                "when it caches prefixes, else 0: no block hashes)"
            )
        if rg.constraint_words != g.constraint_words:
            raise ValueError(
                f"ring constraint_words ({rg.constraint_words}) differs from the loop's ({g.constraint_words})"
            )
        if rg.max_stop_ids != g.max_stop_ids:
            raise ValueError(
                f"ring max_stop_ids ({rg.max_stop_ids}) differs from the loop's ({g.max_stop_ids})"
            )
        if g.max_model_len > 2**24 or g.num_slots * g.max_model_len >= 2**31:
            raise ValueError("token_ids is indexed in int32: num_slots * max_model_len must stay below 2**31")
        want = {
            "slot_state": (g.num_slots,),
            "token_ids": (g.num_slots, g.max_model_len),
            "block_table": (g.num_slots, g.max_blocks_per_seq),
            "stop_ids": (g.num_slots, g.max_stop_ids),
            "free_blocks": (g.num_kv_blocks,),
            "step_slot": (g.max_num_seqs,),
            "counters": (len(COUNTERS),),
        }
        for name, shape in want.items():
            t = getattr(state, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"DeviceState.{name} has shape {tuple(t.shape)}, expected {shape}")
        for name, t in state.tensors().items():
            if t.device != device or not t.is_contiguous():
                raise ValueError(f"DeviceState.{name} must be contiguous on {device}")
        if inputs.input_ids.numel() < g.max_num_batched_tokens:
            raise ValueError("StepInputs hold fewer token rows than the largest bucket")
        if tuple(inputs.block_tables.shape) != (g.max_num_seqs, g.max_blocks_per_seq):
            raise ValueError(
                f"StepInputs.block_tables is {tuple(inputs.block_tables.shape)}, expected "
                f"{(g.max_num_seqs, g.max_blocks_per_seq)} (max_seqs, max_blocks_per_seq)"
            )
        if inputs.query_start.numel() != g.max_num_seqs + 1 or inputs.sample_rows.numel() != g.max_num_seqs:
            raise ValueError("StepInputs are not sized for max_num_seqs")
        if inputs.score_rows.numel() != g.prompt_score_chunk:
            raise ValueError(
                f"StepInputs hold {inputs.score_rows.numel()} score rows; the loop scores up to "
                f"{g.prompt_score_chunk} prompt positions a step (prompt_score_chunk)"
            )
        if inputs.input_ids.device != device:
            raise ValueError(f"StepInputs are on {inputs.input_ids.device}, the loop state on {device}")

    def stamp_phases(self) -> None:
        """From the next launch on, stamp each phase's end in `stamps` (bench/loop_profile.py
        --schedule-phases): a barrier per phase, so a profile only; recompiles the kernel."""
        if not self._constants["ON_GPU"]:
            raise RuntimeError("schedule phase stamps read the GPU's cycle counter: a CUDA device only")
        self._constants["STAMPS"] = True

    @property
    def stamping(self) -> bool:
        return bool(self._constants["STAMPS"])

    def phase_us(self) -> list[float]:
        """The last launch's phase durations in microseconds (after `stamp_phases`; syncs)."""
        s = self.stamps.tolist()
        cycles = s[PHASES] - s[0]
        ns_per_cycle = (s[63] - s[62]) / cycles if cycles > 0 else 0.0
        return [(s[i + 1] - s[i]) * ns_per_cycle / 1e3 for i in range(PHASES)]

    def compile(self) -> None:
        """Compile the kernel for these arguments without running it (it would consume the ring)."""
        schedule_kernel.warmup(grid=(1,), **self._args, **self._constants, num_warps=self.num_warps)

    def launch(self) -> None:
        """Enqueue one schedule step on the current stream (no sync, no allocation: capturable)."""
        self._stamp_host_clock()
        schedule_kernel[(1,)](**self._args, **self._constants, num_warps=self.num_warps)

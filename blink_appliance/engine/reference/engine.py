"""The CPU reference engine: requests in, token events out, one model step per `step()`.

    add_request -> [WAITING] --schedule--> [RUNNING] --commit: stop/length--> [FINISHED]
                       ^                       |
                       +------ preempt --------+        abort: any live state -> FINISHED

`step()` = emit pending abort events, schedule (scheduler.py), forward + sample (model_runner.py),
commit (append each sampled token, stop checks, free finished sequences). docs/engine.md is the spec
the GPU loop follows.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from blink_appliance.engine.reference.block_allocator import BlockAllocator
from blink_appliance.engine.reference.constraint import advance
from blink_appliance.engine.reference.model_runner import ModelRunner
from blink_appliance.engine.reference.scheduler import Scheduler, SchedulerConfig
from blink_appliance.engine.reference.sequence import Sequence
from blink_appliance.model.llama import LlamaModel
from blink_appliance.wire.request import FinishReason, Request, TokenEvent, TokenLogprobs


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    eos_token_ids: tuple[int, ...] | None = None  # None: the model config's
    seed: int | None = None  # draws the seeds of requests that bring none; None: from the OS
    priority_aging_steps: int = 0  # a waiting request gains one priority level per this many steps; 0: off
    lower_class_limit: int = -1  # lower-class running sequences that run beside the top class; -1: no cap
    prefix_cache: bool = False  # reuse the KV blocks of cached prompt prefixes (docs/engine.md)
    prompt_score_chunk: int = 512  # prompt tokens scored (prompt logprobs) per step, at most
    best_effort_batch: int = -1  # best-effort running sequences that step at once, taking turns; -1: all
    best_effort_priority: int = 1  # classes at or past this one are best effort

    def validate(self) -> None:
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "prompt_score_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.priority_aging_steps < 0:
            raise ValueError(
                f"EngineConfig.priority_aging_steps must be >= 0, got {self.priority_aging_steps}"
            )
        if self.lower_class_limit < -1:
            raise ValueError(f"EngineConfig.lower_class_limit must be >= -1, got {self.lower_class_limit}")
        if self.best_effort_batch == 0 or self.best_effort_batch < -1:
            raise ValueError(
                f"EngineConfig.best_effort_batch must be >= 1 or -1, got {self.best_effort_batch}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token of the step budget"
            )
        per_seq = -(-self.max_model_len // self.block_size)
        if self.num_kv_blocks < per_seq:
            raise ValueError(
                f"EngineConfig.num_kv_blocks ({self.num_kv_blocks}) cannot hold one sequence of max_model_len "
                f"{self.max_model_len} ({per_seq} blocks of {self.block_size})"
            )


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int
    generated_tokens: int
    preemptions: int
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        config.validate()
        mc = model.config
        if config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings})"
            )
        self.model = model
        self.config = config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = frozenset(
            mc.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
        )
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.block_size,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.priority_aging_steps,
                config.lower_class_limit,
                config.prefix_cache,
                config.prompt_score_chunk,
                config.best_effort_batch,
                config.best_effort_priority,
            ),
            self.allocator,
        )
        self.runner = ModelRunner(
            model, config.num_kv_blocks, config.block_size, tuple(sorted(self.eos_token_ids))
        )
        self._seed_source = random.Random(config.seed)
        self._live: dict[int, Sequence] = {}  # every request without its terminal event yet
        self._aborted: list[int] = []  # terminal ABORT events for the next step()
        self._arrivals = 0
        self.steps = 0
        self.generated_tokens = 0

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; raises ValueError naming the bad field."""
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id} is already in use by an unfinished request")
        prompt = req.prompt_token_ids
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        if len(prompt) > self.config.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {len(prompt)} tokens, more than max_model_len ({self.config.max_model_len})"
            )
        bad = next((t for t in prompt if not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        req.params.validate()
        bad = next((t for t in req.params.stop_token_ids if not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        bad = next((t for t, _ in req.params.logit_bias if not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(f"logit_bias names token {bad}, outside the vocabulary [0, {self.vocab_size})")
        automaton = req.params.constraint
        if automaton is not None and automaton.tokens.size and int(automaton.tokens.max()) >= self.vocab_size:
            raise ValueError(f"constraint names tokens outside the vocabulary [0, {self.vocab_size})")
        if len(req.block_hashes) > len(prompt) // self.config.block_size:
            raise ValueError(
                f"block_hashes has {len(req.block_hashes)} hashes, more than the prompt's full blocks "
                f"of {self.config.block_size} tokens ({len(prompt) // self.config.block_size})"
            )
        seed = req.params.seed if req.params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(
            request_id=req.request_id,
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            params=req.params,
            priority=req.priority,
            arrival=self._arrivals,
            seed=seed,
            block_hashes=list(req.block_hashes) if self.config.prefix_cache else [],
            constraint_state=automaton.initial if automaton is not None else 0,
        )
        self._arrivals += 1
        self._live[req.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: int) -> None:
        """Free the request's blocks now; its ABORT event comes out of the next step(). Unknown ids: no-op."""
        seq = self._live.get(request_id)
        if seq is None or seq.finish_reason is not None:
            return
        self.scheduler.finish(seq)
        seq.finish_reason = FinishReason.ABORT
        self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        if self._aborted:
            now = time.monotonic_ns()
            for rid in self._aborted:
                del self._live[rid]
                events.append(TokenEvent(rid, None, FinishReason.ABORT, timestamp_ns=now))
            self._aborted.clear()
        if not self.scheduler.has_work():
            return events
        out = self.scheduler.schedule()
        if not out.chunks:
            raise RuntimeError("scheduler produced an empty step with work pending (engine bug)")
        result = self.runner.run(out)
        self.steps += 1
        for c in out.chunks:
            c.seq.num_computed_tokens = c.end
            scored = result.prompt_logprobs.get(c.seq.request_id)
            if scored:
                c.seq.prompt_logprobs_pending.extend(scored)
                c.seq.prompt_logprobs_next += len(scored)
        now = time.monotonic_ns()
        for c, token, lp in zip(out.sampling_chunks, result.tokens, result.logprobs, strict=True):
            events.append(self._commit(c.seq, token, now, lp))
        return events

    def _commit(
        self, seq: Sequence, token: int, now: int, logprobs: TokenLogprobs | None = None
    ) -> TokenEvent:
        """Append a sampled token and apply the stop rules, in order: EOS, stop ids, max_tokens, max_model_len."""
        seq.token_ids.append(token)
        self.generated_tokens += 1
        p = seq.params
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = FinishReason.STOP
        elif p.constraint is not None and not advance(seq, token):
            raise RuntimeError(
                f"request {seq.request_id}: token {token} is outside its constraint (engine bug)"
            )
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            del self._live[seq.request_id]
        prompt = None
        if seq.params.prompt_logprobs and seq.num_output_tokens == 1:
            prompt, seq.prompt_logprobs_pending = tuple(seq.prompt_logprobs_pending), []
        return TokenEvent(
            seq.request_id, token, reason, timestamp_ns=now, logprobs=logprobs, prompt_logprobs=prompt
        )

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_total=self.allocator.num_blocks,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            preemptions=self.scheduler.num_preemptions,
            kv_blocks_cached=self.allocator.num_cached,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
        )

    def generate(self, requests: list[Request]) -> dict[int, list[int]]:
        """Run the given requests to completion on an idle engine; their output tokens by id.

        All or nothing: if one request is refused, the ones already queued are dropped again.
        """
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine (other requests' events would be lost)")
        try:
            for req in requests:
                self.add_request(req)
        except ValueError:
            for rid in list(self._live):
                self.abort(rid)
            self.step()  # drains the abort events
            raise
        pending = {r.request_id for r in requests}
        out: dict[int, list[int]] = {r.request_id: [] for r in requests}
        while pending:
            for e in self.step():
                if e.request_id in out:
                    if e.token_id is not None:
                        out[e.request_id].append(e.token_id)
                    if e.finished:
                        pending.discard(e.request_id)
        return out

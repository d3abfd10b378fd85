"""One iteration of the GPU loop, as separately launchable pieces: schedule, forward, sample, commit.

    schedule (DeviceScheduler)  ->  forward bucket state.bucket_index (GpuForward / ForwardGraphs)
        ->  sample variant state.sampler_index (DeviceSampler)  ->  commit (DeviceCommit)

`LoopStep` owns the loop's state (DeviceState) and the four parts, all bound to the same tensors.
The pieces are what the device loop's graph captures (engine/loop/graph.py `engine_body`, via
`body()`): `schedule`, the sampler's variants and `commit` launch device work on the current
stream with no host sync; the forward enters the graph as ForwardGraphs' per-bucket graphs.
`host_step()` runs the same pieces for one iteration driven from the host (engine.mode = "host", and
the CPU harness): it reads bucket_index and sampler_index back to choose the branches, as the
graph's SWITCH nodes do on the device, and waits for the iteration to end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch

from blink_appliance.engine.loop.commit import DeviceCommit
from blink_appliance.engine.loop.constraint import DeviceConstraints
from blink_appliance.engine.loop.forward_graphs import ForwardGraphs
from blink_appliance.engine.loop.graph import Segment, engine_body
from blink_appliance.engine.loop.logprobs import DeviceLogprobs, DevicePromptLogprobs
from blink_appliance.engine.loop.penalties import DevicePenalties
from blink_appliance.engine.loop.progress import CompileAhead, stage
from blink_appliance.engine.loop.sampler import DeviceSampler
from blink_appliance.engine.loop.scheduler import DeviceScheduler
from blink_appliance.engine.loop.state import DeviceState, LoopGeometry
from blink_appliance.model.config import ModelConfig
from blink_appliance.model.gpu_forward import GpuForward
from blink_appliance.model.gpu_weights import GpuWeights
from blink_appliance.model.kv_cache import PagedKVCache
from blink_appliance.model.launch_plans import decode_gemms, deterministic_gemms
from blink_appliance.model.step_inputs import StepInputs
from blink_appliance.wire.ring_layout import RingLayout


class StepForward(Protocol):
    """What the loop needs of a forward (GpuForward): static inputs schedule writes, fp32 logits
    [max_seqs, V] the sampler reads (row r for sample row r), `step(T)` over the first T rows, and
    `score()`: the logits [score_rows, V] of the prompt rows inputs.score_rows names, after a step."""

    inputs: StepInputs
    logits: torch.Tensor
    max_tokens: int
    max_seqs: int
    score_rows: int

    def step(self, num_tokens: int) -> torch.Tensor: ...

    def score(self) -> torch.Tensor: ...


class LoopStep:
    def __init__(
        self,
        geometry: LoopGeometry,
        state: DeviceState,
        scheduler: DeviceScheduler,
        forward: StepForward,
        sampler: DeviceSampler,
        commit: DeviceCommit,
        graphs: ForwardGraphs | None = None,
    ) -> None:
        if (
            forward.max_tokens < geometry.max_num_batched_tokens
            or forward.max_seqs != geometry.max_num_seqs
            or forward.score_rows != geometry.prompt_score_chunk
        ):
            raise ValueError(
                f"forward sized for {forward.max_tokens} tokens / {forward.max_seqs} sequences / "
                f"{forward.score_rows} scored prompt rows; the loop needs {geometry.max_num_batched_tokens} / "
                f"{geometry.max_num_seqs} / {geometry.prompt_score_chunk}"
            )
        if graphs is not None and tuple(graphs.buckets) != tuple(geometry.buckets):
            raise ValueError(f"captured buckets {graphs.buckets} differ from the loop's {geometry.buckets}")
        self.geometry = geometry
        self.state = state
        self.scheduler = scheduler
        self.forward_runner = forward
        self.sampler = sampler
        self.committer = commit
        self.graphs = graphs
        self._ahead: CompileAhead | None = None
        self._kernels_ready = self._sampler_warm = False  # what warmup() has nothing left to do for

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        weights: GpuWeights,
        region: torch.Tensor,
        layout: RingLayout,
        geometry: LoopGeometry,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        engine_seed: int = 0,
        capture_graphs: bool | None = None,
        deterministic: bool = False,
    ) -> LoopStep:
        """Everything from a model config + weights (GpuWeights.from_hf) and the ring region (a uint8
        tensor over the whole region on `device`). `capture_graphs` (default: on CUDA) captures one
        forward graph per bucket; `engine_seed` derives the seeds of requests that bring none;
        `deterministic` takes the forward's GEMM plan without atomics (`deterministic_gemms`)."""
        device = torch.device(device)
        if geometry.vocab_size != config.vocab_size:
            raise ValueError(f"loop vocab_size {geometry.vocab_size} != model vocab_size {config.vocab_size}")
        if geometry.max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {geometry.max_model_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        if weights.embed.dtype != dtype or weights.embed.device != device:
            raise ValueError(
                f"weights are {weights.embed.dtype} on {weights.embed.device}, not {dtype} on {device}"
            )
        kv = PagedKVCache.allocate(
            config.num_layers, geometry.num_kv_blocks, geometry.block_size, config.num_kv_heads,
            config.head_dim, dtype, device,
        )  # fmt: skip
        forward = GpuForward(
            config, weights, kv, max_tokens=geometry.max_num_batched_tokens, max_seqs=geometry.max_num_seqs,
            max_blocks_per_seq=geometry.max_blocks_per_seq, max_context_len=geometry.max_model_len,
            gemm_plan=deterministic_gemms if deterministic else decode_gemms,
            score_rows=geometry.prompt_score_chunk,
        )  # fmt: skip
        if capture_graphs is None:
            capture_graphs = device.type == "cuda"
        step = cls.assemble(geometry, forward, region, layout, engine_seed=engine_seed)
        if capture_graphs:
            step.graphs = ForwardGraphs(forward, geometry.buckets)
            step.compile_ahead()  # the schedule and commit kernels build while the rest compiles
            step.graphs.warm()
            step.warm_sampler()
            # Joined before any capture: a kernel module loaded on another thread during a global
            # stream capture would break it.
            step.wait_compiled()
            step.graphs.capture_warm()
        return step

    @classmethod
    def assemble(
        cls,
        geometry: LoopGeometry,
        forward: StepForward,
        region: torch.Tensor,
        layout: RingLayout,
        *,
        engine_seed: int = 0,
        graphs: ForwardGraphs | None = None,
    ) -> LoopStep:
        """A fresh DeviceState and the schedule / sample / commit parts around an existing forward."""
        state = DeviceState.allocate(geometry, forward.logits.device)
        scheduler = DeviceScheduler(geometry, state, region, layout, forward.inputs, engine_seed)
        logprobs = prompt = None
        if layout.geometry.logprob_pairs:
            logprobs = DeviceLogprobs(state, forward.logits, region, layout, max_rows=forward.score_rows)
            prompt = DevicePromptLogprobs(state, forward.score, logprobs)
        sampler = DeviceSampler(
            state, forward.logits, logprobs=logprobs, penalties=DevicePenalties(state, forward.logits),
            prompt_logprobs=prompt, constraints=DeviceConstraints(geometry, state, forward.logits),
        )  # fmt: skip
        commit = DeviceCommit(geometry, state, region, layout)
        return cls(geometry, state, scheduler, forward, sampler, commit, graphs)

    # -- the pieces (capturable: no host sync) -----------------------------------------------------------
    def schedule(self) -> None:
        self.scheduler.launch()

    def commit(self) -> None:
        self.committer.launch()

    def forward_bucket(self, index: int) -> None:
        """Run forward bucket `index` (of geometry.buckets): its graph when captured, else eagerly."""
        T = self.geometry.buckets[index]
        if self.graphs is not None:
            self.graphs.replay(T)
        else:
            self.forward_runner.step(T)

    def body(self) -> list[Segment]:
        """The loop body for DeviceLoop (needs the captured forward graphs)."""
        if self.graphs is None:
            raise RuntimeError("the device loop's body needs captured forward graphs (build on CUDA)")
        return engine_body(
            bucket_index=self.state.bucket_index, sampler_index=self.state.sampler_index,
            forward=self.graphs, schedule=self.schedule, samplers=self.sampler.variants(),
            commit=self.commit,
        )  # fmt: skip

    # -- host-driven pieces (they read the SWITCH values back: a sync each) ------------------------------
    def forward(self) -> bool:
        """Run the bucket schedule chose; False when it chose none (no forward this iteration)."""
        index = int(self.state.bucket_index[0])
        if not 0 <= index < len(self.geometry.buckets):
            return False
        self.forward_bucket(index)
        return True

    def sample(self) -> None:
        """Run the variant schedule chose (DeviceSampler.variants(); other values: none, as the SWITCH)."""
        self.sampler.run()

    def host_step(self) -> None:
        """One loop iteration driven by the host: schedule, forward, sample, commit, then wait for it."""
        self.schedule()
        if self.forward():
            self.sample()
        self.commit()
        if self.state.keep_running.is_cuda:
            torch.cuda.current_stream(self.state.keep_running.device).synchronize()

    def _kernel_compile(self) -> tuple[str, Callable[[], None] | None]:
        """What compiling the schedule and commit kernels means here: a name for the log and the
        compile call (None where Triton interprets them: nothing to compile on the CPU)."""
        g = self.geometry
        what = f"compiling the schedule and commit kernels ({g.num_slots} slots, {g.max_num_seqs} sequences)"
        if not self.state.keep_running.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
            return what, None

        def compile_both() -> None:
            self.scheduler.compile()
            self.committer.compile()

        return what, compile_both

    def compile_ahead(self) -> None:
        """Start compiling the schedule and commit kernels on a thread (progress.CompileAhead);
        `wait_compiled` waits for them. They need no forward, so they build while its buckets compile."""
        what, compile_both = self._kernel_compile()
        if compile_both is not None and self._ahead is None:
            self._ahead = CompileAhead(what, compile_both, self.state.keep_running.device)

    def wait_compiled(self) -> None:
        """The schedule and commit kernels compiled: waited for when `compile_ahead` started them,
        else compiled now; once."""
        if self._kernels_ready:
            return
        if self._ahead is not None:
            self._ahead.wait()
        else:
            what, compile_both = self._kernel_compile()
            with stage(what):
                if compile_both is not None:
                    compile_both()
        self._kernels_ready = True

    def warm_sampler(self) -> None:
        """Run every sampler variant once (it writes nothing but `sampled`): compiles them; once."""
        if self._sampler_warm:
            return
        with stage(f"compiling and warming {len(self.sampler.variants())} sampler variants"):
            for variant in self.sampler.variants():
                variant()
        self._sampler_warm = True

    def warmup(self) -> None:
        """Compile and warm what the loop's graph captures, without touching the loop's state or the
        ring: the schedule and commit kernels are compiled only (running them would admit records and
        publish), the sampler runs. `build` has done both when it captured the forward."""
        self.wait_compiled()
        self.warm_sampler()

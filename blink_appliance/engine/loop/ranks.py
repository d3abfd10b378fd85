"""The GPU loop over two tensor-parallel ranks in one engine process (docs/tensor_parallel.md).

Rank 0 is the loop as on one GPU (its LoopStep: ring, schedule, sampler, commit) around its share of
the forward; rank 1 runs a follower loop that copies each of rank 0's step plans and runs the same
bucket of its own share (engine/loop/plan_link.py). The two loops are launched, watched and ended as
one (`LinkedLoops`); rank 1 ends once rank 0's loop has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from blink_appliance.engine.loop.control import LoopControl
from blink_appliance.engine.loop.forward_graphs import ForwardGraphs
from blink_appliance.engine.loop.graph import DeviceLoop, poll_until_ended
from blink_appliance.engine.loop.mapped_region import RingWords
from blink_appliance.engine.loop.plan_link import PlanLink, follower_body, leader_body
from blink_appliance.engine.loop.progress import stage
from blink_appliance.engine.loop.state import LoopGeometry
from blink_appliance.engine.loop.step import LoopStep
from blink_appliance.model.config import ModelConfig
from blink_appliance.model.gpu_forward import GpuForward
from blink_appliance.model.gpu_weights import GpuWeights
from blink_appliance.model.kv_cache import PagedKVCache
from blink_appliance.model.launch_plans import deterministic_gemms
from blink_appliance.model.tensor_parallel import connect, shard_config, shard_weights, warm_alone
from blink_appliance.wire.ring_layout import RingLayout


@dataclass
class TensorParallelLoop:
    """Rank 0's LoopStep and rank 1's forward, graphs and link."""

    step: LoopStep
    follower: GpuForward
    follower_graphs: ForwardGraphs
    links: tuple[PlanLink, PlanLink]

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        hf_weights: Mapping[str, torch.Tensor],
        region: torch.Tensor,
        layout: RingLayout,
        geometry: LoopGeometry,
        devices: Sequence[str],
        dtype: torch.dtype,
        *,
        engine_seed: int = 0,
    ) -> TensorParallelLoop:
        """Both ranks from the whole model's HF-named weights: sharded through host memory (the
        whole model never sits on one GPU), each rank's KV cache of its own KV heads, the forward
        graphs warmed with each rank alone and then captured. The ranks take the GEMM plan without
        atomics: each norm adds the two shares in one order."""
        if len(devices) != 2:
            raise ValueError(f"tensor parallelism runs over 2 devices, got {list(devices)}")
        ranks = [torch.device(d) for d in devices]
        local = shard_config(config, 2)
        with stage("sharding the weights over " + ", ".join(devices)):
            whole = GpuWeights.from_hf(config, dict(hf_weights), dtype, "cpu")
            shards = [shard_weights(whole, config, r, 2, dev) for r, dev in enumerate(ranks)]
            del whole
        forwards = []
        for r, (dev, weights) in enumerate(zip(ranks, shards, strict=True)):
            with torch.cuda.device(dev):
                kv = PagedKVCache.allocate(
                    local.num_layers, geometry.num_kv_blocks, geometry.block_size, local.num_kv_heads,
                    local.head_dim, dtype, dev,
                )  # fmt: skip
                forwards.append(
                    GpuForward(
                        local,
                        weights,
                        kv,
                        max_tokens=geometry.max_num_batched_tokens,
                        max_seqs=geometry.max_num_seqs,
                        max_blocks_per_seq=geometry.max_blocks_per_seq,
                        max_context_len=geometry.max_model_len,
                        gemm_plan=deterministic_gemms,
                        score_rows=geometry.prompt_score_chunk,
                        tp_rank=r,
                    )  # fmt: skip
                )
        connect(*forwards)
        graphs = [ForwardGraphs(f, geometry.buckets) for f in forwards]
        # Every kernel compiled and loaded on both GPUs before a rank can wait on the other; capture
        # runs nothing, so it comes after, with the ranks joined.
        warm_alone(forwards, lambda fwd: graphs[fwd.tp.rank].warm())
        for g in graphs:
            with torch.cuda.device(g.forward.device):
                g.capture_warm()
        step = LoopStep.assemble(
            geometry, forwards[0], region, layout, engine_seed=engine_seed, graphs=graphs[0]
        )
        return cls(step, forwards[1], graphs[1], PlanLink.pair(ranks[0], ranks[1]))

    def loops(self, ring: RingWords, control: LoopControl) -> LinkedLoops:
        """Both ranks' device loops, captured (not launched); `control` is rank 0's."""
        lead, follow = self.links
        state, d1 = self.step.state, self.follower.device
        no_bucket = len(self.follower_graphs.buckets)
        bucket = torch.full((1,), no_bucket, dtype=torch.int32, device=d1)
        keep_running = torch.ones(1, dtype=torch.int32, device=d1)
        self._warm_link(bucket, keep_running, no_bucket)
        with stage("capturing both ranks' device loops"):
            leader = DeviceLoop(
                leader_body(lead, self.step.body(), state.keep_running),
                num_active=state.num_active, keep_running=state.keep_running, ring=ring, control=control,
            )  # fmt: skip
            follower = DeviceLoop(
                follower_body(
                    follow, self.step.forward_runner.inputs, self.follower.inputs, state.bucket_index, bucket,
                    keep_running, self.follower_graphs,
                ),
                num_active=torch.zeros(1, dtype=torch.int32, device=d1), keep_running=keep_running, ring=None,
                control=LoopControl(d1),
            )  # fmt: skip
        return LinkedLoops(leader, follower)

    def _warm_link(self, bucket: torch.Tensor, keep_running: torch.Tensor, no_bucket: int) -> None:
        """Compile and load the link's kernels on their GPUs, for the tensors the loops pass them, by
        one plan over scratch words: the loops' own words stay at zero, rank 1's inputs take rank
        0's (as every plan gives them), its bucket and keep_running keep their values."""
        state, d0, d1 = self.step.state, self.step.state.keep_running.device, self.follower.device
        lead, follow = PlanLink.pair(d0, d1)
        with torch.cuda.device(d0):
            lead.before_schedule()
            lead.after_schedule()
        with torch.cuda.device(d1):
            follow.follow(
                self.step.forward_runner.inputs, self.follower.inputs, state.bucket_index, bucket, keep_running,
                no_bucket,
            )  # fmt: skip
        with torch.cuda.device(d0):
            lead.after_commit(state.keep_running)
        for d in (d0, d1):
            torch.cuda.synchronize(d)


class LinkedLoops:
    """Rank 0's and rank 1's device loops as one (server.DeviceLoopLike): rank 1 is launched first,
    to wait for rank 0's first plan, and the pair runs until both have ended."""

    def __init__(self, leader: DeviceLoop, follower: DeviceLoop) -> None:
        self.leader, self.follower = leader, follower

    def launch(self) -> None:
        self.follower.launch()
        self.leader.launch()

    def running(self) -> bool:
        leader, follower = self.leader.running(), self.follower.running()  # both raise a CUDA error
        return leader or follower

    def join(self, timeout_s: float | None = None, poll_s: float = 0.0002) -> bool:
        return poll_until_ended(self.running, timeout_s, poll_s)

    def close(self) -> None:
        self.leader.close()
        self.follower.close()

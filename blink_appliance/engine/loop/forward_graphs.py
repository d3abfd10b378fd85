"""One captured CUDA graph of the forward per token bucket, all sharing one memory pool.

The GPU loop's scheduler picks the smallest bucket that holds the step's tokens and switches to that
bucket's graph; `raw_cuda_graph(T)` hands out the cudaGraph_t (captured with keep_graph=True) so the
loop can embed it as a child graph of its WHILE/SWITCH nodes. All buckets read the same static inputs
and write the same logits buffer (GpuForward), so only one runs at a time by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blink_appliance.engine.loop.progress import stage
from blink_appliance.model.gpu_forward import GpuForward
from blink_appliance.profile import DEFAULT_BUCKETS


class ForwardGraphs:
    def __init__(self, forward: GpuForward, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if forward.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the forward on a CUDA device, not {forward.device}")
        if not buckets or any(b <= 0 for b in buckets):
            raise ValueError(f"token buckets must be positive, got {list(buckets)}")
        if max(buckets) > forward.max_tokens:
            raise ValueError(f"bucket {max(buckets)} exceeds the forward's max_tokens {forward.max_tokens}")
        self.forward = forward
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def capture(self, warmup_steps: int = 2) -> None:
        """Warm up (Triton compilation, cuBLAS handles) on an empty step, then capture every bucket."""
        self.warm(warmup_steps)
        self.capture_warm()

    def warm(self, warmup_steps: int = 2) -> None:
        """Run every bucket on an empty step: it compiles and loads the kernels capture records.

        Warm-up runs real kernels, so it runs on cleared inputs (no KV writes, no sequences); the
        inputs are restored afterwards."""
        fwd = self.forward
        saved = {k: v.clone() for k, v in vars(fwd.inputs).items()}
        fwd.inputs.clear()
        stream = torch.cuda.Stream(device=fwd.device)
        stream.wait_stream(torch.cuda.current_stream(fwd.device))
        with torch.cuda.stream(stream):
            for i, T in enumerate(self.buckets):  # the first pass compiles each bucket's kernels
                with stage(f"forward bucket {T} ({i + 1}/{len(self.buckets)}): compiling and warming"):
                    for _ in range(warmup_steps):
                        fwd.step(T)
                    torch.cuda.synchronize(fwd.device)
        torch.cuda.current_stream(fwd.device).wait_stream(stream)
        torch.cuda.synchronize(fwd.device)
        for k, v in saved.items():
            getattr(fwd.inputs, k).copy_(v)

    def capture_warm(self) -> None:
        """Capture every bucket (after `warm`). Capture itself executes nothing."""
        self.pool = torch.cuda.graph_pool_handle()
        with stage(f"capturing {len(self.buckets)} forward graphs"):
            self._capture_buckets()

    def _capture_buckets(self) -> None:
        fwd = self.forward
        # torch's default capture stream lives on the device that first captured in the process:
        # a forward on another GPU (tensor parallelism) would be captured onto that one's.
        stream = torch.cuda.Stream(fwd.device)
        # Largest first, so later (smaller) captures reuse the pool's blocks.
        for T in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                fwd.step(T)
            graph.instantiate()
            self.graphs[T] = graph
        torch.cuda.synchronize(fwd.device)

    def bucket_for(self, num_tokens: int) -> int:
        for T in self.buckets:
            if num_tokens <= T:
                return T
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def _graph(self, num_tokens: int) -> torch.cuda.CUDAGraph:
        if num_tokens not in self.graphs:
            raise KeyError(f"no captured graph for bucket {num_tokens} (captured: {sorted(self.graphs)})")
        return self.graphs[num_tokens]

    def replay(self, num_tokens: int) -> torch.Tensor:
        """Replay bucket `num_tokens` (asynchronously); returns the logits view it writes."""
        self._graph(num_tokens).replay()
        return self.forward.logits[: self.forward.num_sample_rows(num_tokens)]

    def raw_cuda_graph(self, num_tokens: int) -> int:
        """The bucket's cudaGraph_t, for cudaGraphAddChildGraphNode in the device loop."""
        return self._graph(num_tokens).raw_cuda_graph()

    def raw_cuda_graph_exec(self, num_tokens: int) -> int:
        return self._graph(num_tokens).raw_cuda_graph_exec()

"""One batch-1 forward of the shipped plan, replayed from its CUDA graph between cudaProfilerStart and
Stop, for Nsight Compute (`ncu --profile-from-start off`, bench/ncu_step.sh): every kernel of the
step is profiled once, in launch order.

    PYTHONPATH=. python3 bench/ncu_forward.py [--model llama-3.2-1b] [--context 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import BLOCK_SIZE, MAX_SEQS, Workload, load_workload  # noqa: E402

from blink_appliance.engine.loop.forward_graphs import ForwardGraphs  # noqa: E402
from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.presets import preset_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    cfg = preset_config(args.model)
    weights = GpuWeights.random(cfg, torch.bfloat16, "cuda", seed=0)
    max_blocks = (args.context + 1) // BLOCK_SIZE + 2
    num_blocks = args.context // BLOCK_SIZE + 8
    kv = PagedKVCache.allocate(
        cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda"
    )
    fwd = GpuForward(cfg, weights, kv, max_tokens=1, max_seqs=MAX_SEQS, max_blocks_per_seq=max_blocks)
    graphs = ForwardGraphs(fwd, buckets=(1,))
    graphs.capture()
    load_workload(
        fwd, Workload(1, decodes=1, prefill=0, context=args.context), cfg.vocab_size, num_blocks, max_blocks
    )
    graphs.replay(1)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    graphs.replay(1)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"{torch.cuda.get_device_name()}: one {args.model} batch-1 step replayed under the profiler")


if __name__ == "__main__":
    main()

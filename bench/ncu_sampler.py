"""The device sampler's variants called eagerly, for Nsight Compute (bench/ncu_sampler.sh): one
sampling mix at a row count on flat or peaked logits, the picked variant called `--calls` times after
checking its tokens against the reference sampler.

    PYTHONPATH=. python3 bench/ncu_sampler.py --rows 64 --mix "temperature 0.7, top_p 0.9" [--shape flat]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # a check of the harness under the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_profile import MIXES, logits_of  # noqa: E402

from blink_appliance.engine.loop.sampler import DeviceSampler  # noqa: E402
from blink_appliance.engine.reference.sampler import SamplingTensors, sample  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.test_device_sampler import load_rows, make_state, variant_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--mix", default="temperature 0.7, top_p 0.9", choices=list(MIXES) + ["greedy"])
    ap.add_argument("--shape", default="flat", choices=("flat", "peaked"))
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = logits_of(args.shape, args.rows, args.vocab, device)
    mix = {} if args.mix == "greedy" else MIXES[args.mix]
    params = [SamplingParams(seed=1000 + r, max_tokens=1, **mix) for r in range(args.rows)]
    output_index = [r % 7 for r in range(args.rows)]
    state = make_state(args.rows, args.vocab)
    load_rows(state, params, output_index)
    sampler = DeviceSampler(state, logits)
    picked = sampler.variants()[variant_for(params)]
    picked()
    want = sample(logits.cpu(), SamplingTensors.build(params, [p.seed for p in params], output_index, "cpu"))
    print(
        f"{args.rows} rows, {args.mix}, {args.shape}: mismatches {int((state.sampled.cpu() != want).sum())}"
    )
    for _ in range(args.calls):
        picked()
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

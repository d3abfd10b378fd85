"""`blink-appliance`: up, check, models pull|list, top, bench serve|interfere."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from blink_appliance.profile import Profile, ProfileError, load_profile, ring_geometry

if TYPE_CHECKING:
    from blink_appliance.model.config import ModelConfig


def _cmd_up(args: argparse.Namespace) -> int:
    from blink_appliance.daemon import run_up

    profile = load_profile(args.profile)
    return run_up(profile, Path(args.profile).resolve(), host=args.host, port=args.port)


def _cmd_check(args: argparse.Namespace) -> int:
    """Everything that can be checked from metadata; the verdict comes last, after every check ran."""
    try:
        profile = load_profile(args.profile)
        unchecked = _check_profile(profile, load=args.load)
    except ProfileError as e:
        print(f"profile {args.profile}: invalid: {e}", file=sys.stderr)
        return 2
    if unchecked:
        print(
            f"profile {args.profile}: valid as far as this machine can tell; not checked: {'; '.join(unchecked)}"
        )
    else:
        print(f"profile {args.profile}: valid")
    return 0


def _check_profile(profile: Profile, *, load: bool) -> list[str]:
    """Print what the profile resolves to; raise ProfileError naming the key of the first problem.
    Returns what could not be checked here (a model not pulled yet, a device this machine lacks)."""
    from blink_appliance.model.metadata import ModelNotCached, read_checkpoint_info
    from blink_appliance.model.sources import parse_source

    m = profile.model
    key = "models[0].source" if m.source is not None else "models[0].name"
    unchecked: list[str] = []
    try:
        if load:
            from blink_appliance.daemon import ensure_model

            ensure_model(m.model_source)
        info = read_checkpoint_info(m.model_source)
    except ModelNotCached as e:
        print(f"model: {e}")
        unchecked.append("the checkpoint and the memory plan (the model is not pulled yet)")
        info = None
    except (FileNotFoundError, ValueError) as e:
        raise ProfileError(f"{key}: {e}") from None
    if info is not None:
        print(info.describe())
        if info.tokenizer is None and parse_source(m.model_source)[0] != "dummy":
            raise ProfileError(
                f"{key}: {m.model_source!r} has no tokenizer (tokenizer.json), and the HTTP front end needs one"
            )
        unchecked += _check_plan(profile, info.config)
    if load:
        _load_weights(m.model_source, m.seed)
    _print_rings_and_front_end(profile)
    return unchecked


def _check_plan(profile: Profile, config: ModelConfig) -> list[str]:
    """The memory plan and the loop's geometry; a CUDA device this machine lacks is said, not guessed."""
    from blink_appliance.engine.plan import resolve_plan

    m = profile.model
    missing = _missing_device(m.device)
    if missing is None:
        plan = resolve_plan(m, config)
        print(plan.describe())
    else:
        # Without the device the budget of kv_fraction is unknown: plan with room for every block
        # the limits can use (the other checks still run), and say so instead of printing a size.
        plan = resolve_plan(m, config, available_bytes=1 << 62)
        lines = plan.describe().splitlines()
        if m.kv_fraction is not None:
            lines = [
                f"  kv cache       kv_fraction={m.kv_fraction} of {m.device}'s free memory after the weights, "
                f"sized when the engine starts (at most {plan.num_kv_blocks} blocks x {plan.block_size} tokens "
                "are used)"
                if line.startswith("  kv cache")
                else line
                for line in lines
            ]
        print("\n".join(lines))
    if profile.uses_loop:
        from blink_appliance.engine.loop.geometry import loop_geometry

        g = loop_geometry(profile, plan, config)
        print(
            f"engine {profile.engine_mode}: the GPU loop, {g.num_slots} request slots, {g.max_num_seqs} sequences "
            f"a step, forward buckets {list(g.buckets)} tokens"
        )
    else:
        print(f"engine {profile.engine_mode}: the CPU reference engine")
    if missing is None:
        return []
    print(f"device {m.device}: {missing}")
    what = "the device and the KV cache size" if m.kv_fraction is not None else "the device"
    return [f"{what} ({missing})"]


def _missing_device(device: str) -> str | None:
    """Why `device` cannot be checked on this machine, or None when it is here."""
    if device == "cpu":
        return None
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1])
    return None if index < found else f"this machine has {found} CUDA device(s)"


def _load_weights(source: str, seed: int) -> None:
    """--load: read and decode every weight, as the engine will."""
    from blink_appliance.model.loaders import load_checkpoint

    started = time.monotonic()
    ckpt = load_checkpoint(source, seed=seed)
    print(f"loaded {len(ckpt.weights)} tensors in {time.monotonic() - started:.1f}s")


def _print_rings_and_front_end(profile: Profile) -> None:
    from blink_appliance.wire.ring_layout import region_size

    geometry = ring_geometry(profile)
    fe = profile.frontend
    print(
        f"rings /dev/shm/{profile.appliance.shm_name}: {region_size(geometry) / 2**20:.1f} MiB "
        f"({geometry.max_inflight} in flight, {geometry.request_slots} request slots, "
        f"{geometry.arena_tokens} prompt tokens)"
    )
    auth = "bearer keys" if fe.api_keys else "no API keys (BLINK_API_KEY may add one)"
    print(f"front end http://{fe.host}:{fe.port} over {fe.transport}, {auth}")


def _cmd_models_pull(args: argparse.Namespace) -> int:
    from blink_appliance.model import registry

    path = registry.pull(args.name)
    print(path)
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from blink_appliance.model import registry

    for entry in registry.list_models():
        print(entry)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blink-appliance",
        description="LLM serving appliance whose token loop never touches the host CPU",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('blink-appliance')}")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the appliance described by a profile and serve until stopped")
    up.add_argument("profile", help="TOML profile, e.g. profiles/default.toml")
    up.add_argument("--host", default=None, help="override frontend.host")
    up.add_argument("--port", type=int, default=None, help="override frontend.port (0: any free port)")
    up.set_defaults(func=_cmd_up)

    check = sub.add_parser(
        "check",
        help="validate a profile from the model's metadata (no weight load, no download) and print the plan",
    )
    check.add_argument("profile")
    check.add_argument(
        "--load", action="store_true", help="also pull a named model and read and decode every weight"
    )
    check.set_defaults(func=_cmd_check)

    models = sub.add_parser("models", help="named models: pull into the local cache, list")
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="download a named model into the local cache")
    pull.add_argument("name")
    pull.set_defaults(func=_cmd_models_pull)
    lst = msub.add_parser("list", help="list named models and whether they are cached")
    lst.set_defaults(func=_cmd_models_list)

    top = sub.add_parser("top", help="live dashboard of a running appliance")
    try:
        from blink_appliance.tui.app import add_arguments as add_top_arguments
    except ImportError as e:
        # A serving host may lack the dashboard's packages (textual); `up` and `bench` must still run.
        top.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        top.set_defaults(func=_top_unavailable(e))
    else:
        add_top_arguments(top)
        top.set_defaults(func=_cmd_top)

    from blink_appliance.bench.commands import add_bench_parser

    add_bench_parser(sub)
    return parser


def _top_unavailable(error: ImportError) -> Callable[[argparse.Namespace], int]:
    def refuse(args: argparse.Namespace) -> int:
        print(f"error: blink-appliance top needs the dashboard's packages: {error}", file=sys.stderr)
        return 2

    return refuse


def _cmd_top(args: argparse.Namespace) -> int:
    from blink_appliance.tui.app import run_dashboard

    run_dashboard(args.url, args.api_key)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`blink-appliance`: up, check, models pull|list, top, bench serve|interfere."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from blink_appliance.profile import ProfileError, load_profile, ring_geometry


def _cmd_up(args: argparse.Namespace) -> int:
    from blink_appliance.daemon import run_up

    profile = load_profile(args.profile)
    return run_up(profile, Path(args.profile).resolve(), host=args.host, port=args.port)


def _cmd_check(args: argparse.Namespace) -> int:
    from blink_appliance.daemon import ensure_model
    from blink_appliance.engine.plan import resolve_plan
    from blink_appliance.model.loaders import load_checkpoint
    from blink_appliance.wire.ring_layout import region_size

    profile = load_profile(args.profile)
    m = profile.model
    print(f"profile {args.profile}: valid")
    ensure_model(m.model_source)
    # The architecture comes from the checkpoint itself, so the plan is what `up` will use.
    config = load_checkpoint(m.model_source, seed=m.seed).config
    plan = resolve_plan(m, config)
    print(plan.describe())
    if profile.uses_loop:
        from blink_appliance.engine.loop.geometry import loop_geometry

        g = loop_geometry(profile, plan, config)
        print(
            f"engine {profile.engine_mode}: the GPU loop, {g.num_slots} request slots, {g.max_num_seqs} sequences "
            f"a step, forward buckets {list(g.buckets)} tokens"
        )
    else:
        print(f"engine {profile.engine_mode}: the CPU reference engine")
    geometry = ring_geometry(profile)
    fe = profile.frontend
    print(
        f"rings /dev/shm/{profile.appliance.shm_name}: {region_size(geometry) / 2**20:.1f} MiB "
        f"({geometry.max_inflight} in flight, {geometry.request_slots} request slots, "
        f"{geometry.arena_tokens} prompt tokens)"
    )
    auth = "bearer keys" if fe.api_keys else "no API keys (BLINK_API_KEY may add one)"
    print(f"front end http://{fe.host}:{fe.port} over {fe.transport}, {auth}")
    return 0


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
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the appliance described by a profile and serve until stopped")
    up.add_argument("profile", help="TOML profile, e.g. profiles/default.toml")
    up.add_argument("--host", default=None, help="override frontend.host")
    up.add_argument("--port", type=int, default=None, help="override frontend.port (0: any free port)")
    up.set_defaults(func=_cmd_up)

    check = sub.add_parser("check", help="validate a profile and print the resolved plan")
    check.add_argument("profile")
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

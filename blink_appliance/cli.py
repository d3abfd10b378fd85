"""`blink-appliance`: up, fleet, frontend, check, models pull|list, top, bench serve|interfere."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from blink_appliance.profile import (
    Profile,
    ProfileError,
    load_profile,
    region_name,
    ring_geometry,
)

if TYPE_CHECKING:
    from blink_appliance.engine.plan import ModelPlan
    from blink_appliance.model.config import ModelConfig


def _cmd_up(args: argparse.Namespace) -> int:
    from blink_appliance.daemon import run_up

    profile = load_profile(args.profile)
    return run_up(profile, Path(args.profile).resolve(), host=args.host, port=args.port)


def _cmd_fleet(args: argparse.Namespace) -> int:
    load_profile(args.profile)  # a bad profile is refused here, not in every replica
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    try:
        import ray.serve  # noqa: F401
        import tomli_w  # noqa: F401

        from blink_appliance.fleet import serve_fleet
    except ImportError as e:
        print(
            f"error: blink-appliance fleet needs the fleet extra (pip install -e '.[fleet]'): {e}",
            file=sys.stderr,
        )
        return 2
    return serve_fleet(str(Path(args.profile).resolve()), args.replicas, args.host, args.port, args.address)


def _cmd_frontend(args: argparse.Namespace) -> int:
    """The HTTP front end alone, on a host other than the engine's (a DPU): it reaches the rings
    through the ring agent that `up` starts there (frontend.transport "nixl")."""
    from blink_appliance.frontend.__main__ import main as frontend_main

    argv = [args.profile, "--standalone"]
    if args.host is not None:
        argv += ["--host", args.host]
    if args.port is not None:
        argv += ["--port", str(args.port)]
    if args.ready_file is not None:
        argv += ["--ready-file", str(args.ready_file)]
    return frontend_main(argv)


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
    """Print what the profile resolves to, model by model and device by device; raise ProfileError
    naming the key of the first problem. Returns what could not be checked here (a model not pulled
    yet, a device this machine lacks)."""
    unchecked: list[str] = []
    configs: dict[int, ModelConfig] = {}
    for i in range(len(profile.models)):
        config = _check_model(profile, i, load=load)
        if config is None:
            unchecked.append(
                f"{profile.models[i].key(replica=True)}: the checkpoint and the memory plan (the model is not pulled yet)"
                if len(profile.models) > 1
                else "the checkpoint and the memory plan (the model is not pulled yet)"
            )
        else:
            configs[i] = config
    unchecked += _check_plans(profile, configs)
    if load:
        for source, seed in dict.fromkeys((m.model_source, m.seed) for m in profile.models):
            _load_weights(source, seed)
    _print_rings_and_front_end(profile)
    return unchecked


def _check_model(profile: Profile, index: int, *, load: bool) -> ModelConfig | None:
    """models[index]'s checkpoint metadata, printed; None when a named model is not pulled yet."""
    from blink_appliance.model.metadata import ModelNotCached, read_checkpoint_info
    from blink_appliance.model.sources import parse_source

    m = profile.models[index]
    key = m.key("source") if m.source is not None else m.key("name")
    try:
        if load:
            from blink_appliance.daemon import ensure_model

            ensure_model(m.model_source)
        info = read_checkpoint_info(m.model_source)
    except ModelNotCached as e:
        print(f"model: {e}")
        return None
    except (FileNotFoundError, ValueError) as e:
        raise ProfileError(f"{key}: {e}") from None
    print(info.describe())
    if info.tokenizer is None and parse_source(m.model_source)[0] != "dummy":
        raise ProfileError(
            f"{key}: {m.model_source!r} has no tokenizer (tokenizer.json), and the HTTP front end needs one"
        )
    return info.config


def _check_plans(profile: Profile, configs: dict[int, ModelConfig]) -> list[str]:
    """Each model's memory plan and loop geometry, then each CUDA device's SMs and memory; a CUDA
    device this machine lacks is said, not guessed."""
    from blink_appliance.engine.plan import resolve_plans

    # The models of one device plan together: their kv_fractions share what all their weights leave.
    present = {i: c for i, c in configs.items() if _missing_device(profile.models[i].device) is None}
    plans = resolve_plans(profile, present)
    unchecked = []
    for i, config in configs.items():
        m = profile.models[i]
        missing = _missing_device(m.device)
        if missing is None:
            print(plans[i].describe())
        else:
            plans[i] = _plan_without_device(profile, i, config)
        if profile.uses_loop_of(i):
            from blink_appliance.engine.loop.geometry import loop_geometry

            g = loop_geometry(profile, plans[i], config, index=i)
            print(
                f"engine {profile.engine_mode_of(i)}: the GPU loop, {g.num_slots} request slots, "
                f"{g.max_num_seqs} sequences a step, forward buckets {list(g.buckets)} tokens"
            )
        else:
            print(f"engine {profile.engine_mode_of(i)}: the CPU reference engine")
        cache = f"on, over prompt blocks of {m.block_size} tokens" if profile.engine.prefix_cache else "off"
        print(f"prefix cache {cache} ([engine] prefix_cache)")
        if missing is not None:
            print(f"device {m.device}: {missing}")
            what = "the device and the KV cache size" if m.kv_fraction is not None else "the device"
            unchecked.append(
                f"{what} ({missing})"
                if len(profile.models) == 1
                else f"{m.key(replica=True)}: {what} ({missing})"
            )
    return unchecked + _check_devices(profile, plans)


def _plan_without_device(profile: Profile, index: int, config: ModelConfig) -> ModelPlan:
    """Without the device the budget of kv_fraction is unknown: plan with room for every block the
    limits can use (the other checks still run), and say so instead of printing a size."""
    from blink_appliance.engine.plan import resolve_plan

    m = profile.models[index]
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
    return plan


def _check_devices(profile: Profile, plans: dict[int, ModelPlan]) -> list[str]:
    """Each CUDA device's models: their SMs (an MPS share, or the whole GPU) and memory (weights +
    KV); refused when they exceed the device, naming the keys."""
    from blink_appliance.gpu_sharing import mps_needed, plan_shares

    by_device: dict[str, list[int]] = {}
    for i, m in enumerate(profile.models):
        if m.device != "cpu":
            by_device.setdefault(m.device, []).append(i)
    unchecked = []
    present = [d for d in by_device if _missing_device(d) is None]
    for device in by_device:
        if device not in present and any(profile.models[i].sm_count is not None for i in by_device[device]):
            unchecked.append(f"the SM shares of {device} (their sum against its SMs)")
    shares = {}
    if mps_needed(profile) and present:
        shares = {s.model_index: s for s in plan_shares(profile, _device_sms) if s.device in present}
    for device in present:
        indices = by_device[device]
        total_memory = _device_memory(device)
        print(f"device {device}: {_device_sms(device)} SMs, {_fmt_gib(total_memory)} memory")
        for i in indices:
            m = profile.models[i]
            share = shares[i].describe() if i in shares else "the whole GPU"
            memory = (
                f"weights {_fmt_gib(plans[i].weights_bytes)} + KV {_fmt_gib(plans[i].kv_bytes)}"
                if i in plans
                else "memory not planned (the model is not pulled yet)"
            )
            print(f"  {m.key(replica=True)} {m.name!r}: SMs {share}; {memory}")
        used = sum(plans[i].weights_bytes + plans[i].kv_bytes for i in indices if i in plans)
        if used > total_memory:
            keys = " + ".join(
                profile.models[i].key("kv_budget_gib")
                if profile.models[i].kv_budget_gib is not None
                else profile.models[i].key("kv_fraction")
                for i in indices
            )
            raise ProfileError(
                f"{keys}: the weights and KV caches of {device}'s models take {_fmt_gib(used)}, more than "
                f"its {_fmt_gib(total_memory)}"
            )
        print(
            f"  together {_fmt_gib(used)} of {_fmt_gib(total_memory)}; CUDA graphs and workspaces come on "
            "top (not estimated)"
        )
    if shares:
        print("several GPU loops on one device, or sm_count: each model's engine runs under MPS at its share")
    return unchecked


def _device_sms(device: str) -> int:
    import torch

    return torch.cuda.get_device_properties(int(device.split(":")[1])).multi_processor_count


def _device_memory(device: str) -> int:
    import torch

    return torch.cuda.get_device_properties(int(device.split(":")[1])).total_memory


def _fmt_gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


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

    for i in range(len(profile.models)):
        geometry = ring_geometry(profile, i)
        which = f"{profile.models[i].key(replica=True)} " if len(profile.models) > 1 else ""
        print(
            f"{which}rings /dev/shm/{region_name(profile, i)}: {region_size(geometry) / 2**20:.1f} MiB "
            f"({geometry.max_inflight} in flight, {geometry.request_slots} request slots, "
            f"{geometry.arena_tokens} prompt tokens)"
        )
    replicas = any(m.replicas > 1 for m in profile.models)
    if len(profile.models) > 1:
        print(f"engine processes: {len(profile.models)}, one per model" + (" replica" if replicas else ""))
    fe = profile.frontend
    auth = "bearer keys" if fe.api_keys else "no API keys (BLINK_API_KEY may add one)"
    print(f"front end http://{fe.host}:{fe.port} over {fe.transport}, {auth}")
    if profile.dpu is not None:
        from blink_appliance.wire.handshake import load_secret

        d = profile.dpu
        try:
            load_secret(d.secret_file)
        except ValueError as e:  # both hosts need it, and the ring agent would stop on it
            raise ProfileError(str(e)) from None
        ucx = ", ".join(f"{k}={v}" for k, v in d.ucx_env().items()) or "UCX picks devices and transports"
        print(
            f"  runs on {d.frontend_host} (`blink-appliance frontend`); the ring agent listens on "
            f"{d.listen}:{d.port}, dialled at {d.dial_address}; NIXL {d.backend}: {ucx}"
        )


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

    fleet = sub.add_parser(
        "fleet", help="serve several appliances of a profile as one endpoint on Ray Serve (docs/fleet.md)"
    )
    fleet.add_argument("profile", help="the profile every replica runs (the same path on every node)")
    fleet.add_argument("--replicas", type=int, default=2, help="appliances to run (default: 2)")
    fleet.add_argument("--host", default="127.0.0.1", help="where Ray's proxy listens")
    fleet.add_argument("--port", type=int, default=8000)
    fleet.add_argument("--address", default=None, help="a Ray cluster to join (default: start a local one)")
    fleet.set_defaults(func=_cmd_fleet)

    fe = sub.add_parser(
        "frontend",
        help="run the HTTP front end alone (on a DPU), reaching the engine host's rings over NIXL",
    )
    fe.add_argument("profile", help="the same profile the engine host runs, with frontend.transport 'nixl'")
    fe.add_argument("--host", default=None, help="override frontend.host")
    fe.add_argument("--port", type=int, default=None, help="override frontend.port (0: any free port)")
    fe.add_argument("--ready-file", type=Path, default=None, help="write the served URL here when ready")
    fe.set_defaults(func=_cmd_frontend)

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

"""The package layering (docs/architecture.md, "Who imports whom"), read from the import graph.

Every import of a project module, at top level, inside a function or under TYPE_CHECKING, is an edge.
Each module belongs to one area, and each area may import only the areas listed for it; within the
engine the two engines never import each other. The graph has no cycles.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# The area of a module is the longest of these prefixes it starts with.
AREAS = {
    "blink_appliance.wire": "wire",
    "blink_appliance.kernels": "kernels",
    "blink_appliance.processes": "processes",
    "blink_appliance.model": "model",
    "blink_appliance.telemetry": "telemetry",
    "blink_appliance.profile": "profile",
    "blink_appliance.profile_errors": "profile",
    "blink_appliance.profile_checks": "profile",
    "blink_appliance.engine": "engine",
    "blink_appliance.engine.plan": "engine plan",
    "blink_appliance.engine.reference": "reference engine",
    "blink_appliance.engine.loop": "loop engine",
    "blink_appliance.frontend": "frontend",
    "blink_appliance.tui": "tui",
    "blink_appliance.bench": "bench",
    "blink_appliance.daemon": "daemon",
    "blink_appliance.gpu_sharing": "gpu sharing",
    "blink_appliance.ring_agent": "ring agent",
    "blink_appliance.cli": "cli",
    "blink_appliance.fleet": "fleet",
    "blink_appliance": "package",
}
_ENGINE = {"wire", "kernels", "processes", "model", "telemetry", "profile", "engine plan"}
# What each area may import besides itself: data flows profile -> daemon -> engine / front end -> wire.
MAY_IMPORT = {
    "wire": set(),
    "kernels": set(),
    "processes": set(),
    "package": set(),
    "model": {"kernels"},
    "telemetry": {"wire"},
    "profile": {"wire", "model"},
    "engine plan": {"model", "profile"},
    "reference engine": _ENGINE,
    "loop engine": _ENGINE,
    "engine": _ENGINE | {"reference engine", "loop engine"},
    "frontend": {"wire", "processes", "model", "telemetry", "profile"},
    "tui": {"telemetry"},
    "bench": {"telemetry", "model"},
    "gpu sharing": {"profile"},
    "ring agent": {"wire", "processes", "profile"},
    "daemon": {"wire", "processes", "model", "profile", "telemetry", "gpu sharing"},
    "fleet": {
        "profile",
        "processes",
    },  # it runs `up` in a child process: the daemon is below it, not imported
    "cli": _ENGINE
    | {
        "reference engine",
        "loop engine",
        "engine",
        "daemon",
        "tui",
        "bench",
        "gpu sharing",
        "frontend",
        "fleet",
    },
}
# Libraries the front end never loads: it runs on a DPU's Arm cores, where none of them is installed.
GPU_LIBRARIES = {"torch", "triton", "cupy", "cuda"}


def _modules() -> dict[str, Path]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[str, Path] = {}
    for package, folder in tool["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts[:-1]] + ([] if parts[-1] == "__init__" else [parts[-1]]))
            found.setdefault(name, path)
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target
                break


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imported(name, path, modules)) for name, path in modules.items()}


def _area(module: str) -> str:
    best = max((p for p in AREAS if module == p or module.startswith(p + ".")), key=len)
    return AREAS[best]


def test_every_module_has_an_area_and_every_area_a_rule():
    graph = _graph()
    assert len(graph) > 50
    assert {_area(m) for m in graph} <= set(MAY_IMPORT)


def test_no_area_imports_upward():
    wrong = [
        f"{m} ({_area(m)}) imports {t} ({_area(t)})"
        for m, targets in sorted(_graph().items())
        for t in sorted(targets)
        if _area(t) != _area(m) and _area(t) not in MAY_IMPORT[_area(m)]
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else nxt)
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _libraries(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_front_end_reaches_no_gpu_library():
    """Every module the front end can import, at any depth and inside functions too, is free of them."""
    graph, modules = _graph(), _modules()
    seen: set[str] = set()
    todo = [m for m in graph if _area(m) == "frontend"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    reached = sorted(f"{m} ({', '.join(sorted(_libraries(modules[m]) & GPU_LIBRARIES))})" for m in seen
                     if _libraries(modules[m]) & GPU_LIBRARIES)  # fmt: skip
    assert not reached, "the front end's imports reach modules that import GPU libraries:\n" + "\n".join(
        reached
    )


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule catches what it is for: a wire module that imported the engine would be flagged."""
    fake = tmp_path / "fake.py"
    fake.write_text("from blink_appliance.engine.reference.engine import LLMEngine\n")
    modules = _modules() | {"blink_appliance.wire.fake": fake}
    (target,) = _imported("blink_appliance.wire.fake", fake, modules)
    assert target == "blink_appliance.engine.reference.engine"
    assert _area(target) not in MAY_IMPORT[_area("blink_appliance.wire.fake")]

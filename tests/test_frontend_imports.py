"""The front end runs without torch: what it imports, and what loading its tokenizer imports, in a fresh process.

tests/test_layering.py reads the same rule from the source; this test watches the interpreter, so
an import the static graph cannot see (a package's __init__, a library's own imports) is caught too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.gguf_helpers import write_gguf

# Imports every front-end module and every module they import at top level or inside functions
# (TYPE_CHECKING blocks are never executed, so they are skipped), then builds the tokenizer the
# front end would serve each source with, and prints what the interpreter loaded.
_PROBE = textwrap.dedent(
    """
    import ast, importlib, importlib.util, json, pkgutil, sys

    import blink_appliance.frontend as frontend

    def executed_imports(tree):
        todo = list(ast.iter_child_nodes(tree))
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    try:
                        if importlib.util.find_spec(name) is not None:
                            yield name
                    except ModuleNotFoundError:
                        pass
            todo.extend(ast.iter_child_nodes(node))

    modules = ["blink_appliance.frontend.__main__"]
    modules += [m.name for m in pkgutil.walk_packages(frontend.__path__, "blink_appliance.frontend.")]
    for name in modules:
        importlib.import_module(name)
        with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
            for target in executed_imports(ast.parse(f.read())):
                try:
                    importlib.import_module(target)
                except ImportError:
                    if target.startswith("blink_appliance"):
                        raise  # optional libraries may be missing; the project's modules may not

    # The NIXL front end's agent too (frontend.transport "nixl"), where NIXL is installed.
    from blink_appliance.wire.nixl_agent import NixlUnavailableError, make_agent
    try:
        make_agent("import-probe", progress_thread=False)
    except NixlUnavailableError:
        pass

    from blink_appliance.frontend.__main__ import serving_tokenizer

    sizes = {source: serving_tokenizer(source).vocab_size for source in sys.argv[1:]}
    print(json.dumps({"vocab_sizes": sizes, "modules": sorted(sys.modules)}))
    """
)
_FORBIDDEN_LIBRARIES = ("torch", "triton", "cupy")
_FORBIDDEN_PACKAGES = ("blink_appliance.engine", "blink_appliance.kernels")


def _loaded_by_the_front_end(*sources: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *sources], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_the_front_end_and_its_tokenizers_load_no_torch_and_no_engine(tmp_path):
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(gguf_file, hidden=64, head_dim=16, ff=64)
    sources = ("dummy:tiny", "dummy:llama-3.2-1b", f"gguf:{gguf_file}")

    loaded = _loaded_by_the_front_end(*sources)

    sizes = loaded["vocab_sizes"]
    assert sizes["dummy:tiny"] == 512 and sizes["dummy:llama-3.2-1b"] == 128256
    assert sizes[f"gguf:{gguf_file}"] > 256  # the byte-level vocabulary and its merges
    modules = loaded["modules"]
    assert "blink_appliance.frontend.completion_service" in modules  # the probe did import the front end
    libraries = sorted(m for m in modules if m.split(".")[0] in _FORBIDDEN_LIBRARIES)
    assert not libraries, f"the front end loaded {libraries[:10]}"
    project = sorted(m for m in modules if m.startswith(_FORBIDDEN_PACKAGES))
    assert not project, f"the front end loaded {project}"

"""No source file over 500 lines and no function over 150, kernels included (docs/architecture.md).

A file or function that must be longer says why in a comment that starts with `# long:` on its first
line (the file's first line, or the line of the `def`), and is then left out.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 150


def _sources() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / f for f in listed if (ROOT / f).is_file()]


def _excused(line: str) -> bool:
    return "# long:" in line


def _too_long(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    if len(lines) > MAX_FILE_LINES and not (lines and _excused(lines[0])):
        found.append(f"{path.relative_to(root)}: {len(lines)} lines")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _excused(lines[node.lineno - 1]):
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_file_or_function_is_too_long():
    sources = _sources()
    assert len(sources) > 100
    found = [problem for path in sources for problem in _too_long(path)]
    assert not found, "over the size limits (say why with '# long:' if it must be):\n" + "\n".join(found)


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "excused.py").write_text(f"def f():  # long: one table\n{body}\n")
    assert _too_long(tmp_path / "long.py", tmp_path) == [f"long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert _too_long(tmp_path / "excused.py", tmp_path) == []

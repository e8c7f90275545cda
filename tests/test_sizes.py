"""Rooms stay small enough to read (issue 39): no module over 400 lines, no function over 60
but the two named algorithms, whose steps read best in one place."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# The timing harness and the configuration search (docs/design.md).
NAMED_ALGORITHMS = {("stages/measure/timing.py", "interleaved"),
                    ("stages/quantization/tuning.py", "tune")}


def oversized(paths, root: Path) -> list[str]:
    found = []
    for path in paths:
        source = path.read_text()
        relative = path.relative_to(root).as_posix()
        if source.count("\n") > MAX_MODULE_LINES:
            found.append(f"{relative}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and (relative, node.name) not in NAMED_ALGORITHMS:
                    found.append(f"{relative}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_outgrows_its_room():
    paths = [p for folder in ("pipeline", "stages") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert oversized(paths, ROOT) == []


@pytest.mark.parametrize("source, too_big", [
    ("def f():\n" + "    x = 1\n" * 60, True),  # 61 lines
    ("def f():\n" + "    x = 1\n" * 59, False),
    ("x = 1\n" * 401, True),
])
def test_the_check_finds_what_outgrew(tmp_path, source, too_big):
    path = tmp_path / "stages" / "planted.py"
    path.parent.mkdir()
    path.write_text(source)
    assert bool(oversized([path], tmp_path)) is too_big


MAX_MEASUREMENTS_LINES = 250


def test_measurements_hold_current_figures_not_a_diary():
    """docs/measurements.md keeps one current figure per thing and CPU; history is git's."""
    lines = (ROOT / "docs" / "measurements.md").read_text().count("\n")
    assert lines <= MAX_MEASUREMENTS_LINES, (
        f"docs/measurements.md has {lines} lines: replace figures, do not append")

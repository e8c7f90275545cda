"""Imports run one way (docs/design.md, "Layout"): a module imports only its own layer and the
layers below it. The test reads every module's imports, at any depth (a function-level import
counts), so the layering cannot drift back."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Highest first. Layers on one line are peers that must not import each other.
LAYERS = [
    ["pipeline"],
    ["stages.stage"],  # stages/*.py, stages/report/, stages/export/
    ["stages.runtimes"],
    ["stages.training", "stages.quantization"],
    ["stages.measure"],
    ["stages.data", "stages.models"],
    ["stages.run"],
]
RANK = {layer: rank for rank, peers in enumerate(LAYERS) for layer in peers}


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to; None outside the project."""
    parts = module.split(".")
    if parts[0] == "pipeline":
        return "pipeline"
    if parts[0] != "stages" or len(parts) == 1:
        return None
    folder = ".".join(parts[:2])
    return folder if folder in RANK else "stages.stage"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every project import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from stages import runtimes` imports stages.runtimes, not the package stages.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def upward_imports(paths) -> list[str]:
    wrong = []
    for path in paths:
        mine = layer_of(module_name(path))
        for line, imported in imported_modules(path):
            theirs = layer_of(imported)
            if mine is None or theirs is None or theirs == mine:
                continue
            if RANK[theirs] <= RANK[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {imported} "
                             f"({theirs})")
    return wrong


def project_modules():
    # The exported predict_*.py templates run outside the project: they import nothing of it.
    return [p for folder in ("pipeline", "stages") for p in sorted((ROOT / folder).rglob("*.py"))]


def test_every_import_points_down_the_layers():
    assert upward_imports(project_modules()) == []


def test_every_stages_folder_is_a_known_layer():
    folders = {p.name for p in (ROOT / "stages").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"report", "export"} == {key.split(".")[1] for key in RANK
                                              if key.count(".") == 1 and key != "stages.stage"}


@pytest.mark.parametrize("source, layer, wrong", [
    ("from stages import train\n", "run", True),            # the lowest layer imports a stage
    ("from stages.runtimes import pytorch\n", "measure", True),
    ("from stages.training import loop\n", "quantization", True),  # peers
    ("def f():\n    from stages.report import markdown\n", "data", True),  # at any depth
    ("from stages.run.errors import PipelineError\n", "training", False),
    ("from . import errors\n", "run", False),
])
def test_the_check_finds_an_import_that_points_up(tmp_path, monkeypatch, source, layer, wrong):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    module = tmp_path / "stages" / layer / "planted.py"
    module.parent.mkdir(parents=True)
    module.write_text(source)
    assert bool(upward_imports([module])) is wrong

"""The docs name only what exists: every --flag in the README and docs/ is an option of the
command line, of a benchmark script or of the tools the docs show (torchrun), and every test
they cite by name is a test of this suite (issue 52: stale claims had crept in)."""
import ast
import re
from pathlib import Path

import click

from pipeline.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OTHER_TOOLS = {"--nproc_per_node", "--standalone", "--help"}  # torchrun's, and --help


def _cli_flags() -> set[str]:
    flags = set()
    for command in [cli, *cli.commands.values()]:
        for param in command.params:
            if isinstance(param, click.Option):
                flags.update(param.opts + param.secondary_opts)
    return flags


def _benchmark_flags() -> set[str]:
    flags = set()
    for script in (ROOT / "benchmarks").glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                flags.add(node.args[0].value)
    return flags


def _test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.add(path.stem)
        names.update(re.findall(r"^def (test_\w+)", path.read_text(), re.MULTILINE))
    return names


def test_every_flag_the_docs_name_exists():
    known = _cli_flags() | _benchmark_flags() | OTHER_TOOLS
    for doc in DOCS:
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", doc.read_text()))
        assert sorted(named - known) == [], doc.name


def test_every_test_the_docs_cite_exists():
    known = _test_names()
    for doc in DOCS:
        cited = set(re.findall(r"\btest_[a-z0-9_]+(?=[`:.,) ]|$)", doc.read_text(), re.MULTILINE))
        cited -= {"test_accuracy", "test_fraction"}  # report.json and manifest fields, not tests
        assert sorted(cited - known) == [], doc.name

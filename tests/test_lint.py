"""What the code may not call, checked by ruff with the rules pyproject.toml selects: no
unpickling (S301, S302), no exec or eval of text (S102, S307), and the banned APIs (TID251:
torch.load outside stages/run/loading.py, torch.export.load outside the exported script,
torch.jit.load, torch.ao.quantization). Only those rules run here: ruff's default set changes
between releases. What ruff cannot see, a keyword argument that turns a loader's guard off, is
read from the syntax tree below."""
import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"][
    "extend-select"]
FOLDERS = ("pipeline", "stages", "benchmarks")


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", "--select", ",".join(RULES), *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120)


def test_no_code_unpickles_evaluates_text_or_calls_a_banned_api():
    proc = _ruff(*FOLDERS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


PLANTED = """\
import marshal, pickle

import torch
from torch.ao.quantization.quantize_fx import prepare_fx

state = torch.load("model.pt", weights_only=True)
program = torch.export.load("model.pt2")
script = torch.jit.load("model.ts")
payload = pickle.loads(b"")
value = eval("1 + 1")
code = marshal.loads(b"")
exec("x = 1")
"""


def test_the_rules_flag_each_banned_call_and_exempt_only_their_one_file():
    """The configuration itself: each call above is flagged in any module, and the two files
    allowed a banned API are allowed that one."""
    flagged = _ruff("--stdin-filename", "stages/planted.py", "-", stdin=PLANTED)
    assert flagged.returncode == 1, flagged.stdout + flagged.stderr
    found = {(int(line.split(":")[1]), line.split()[1]) for line in flagged.stdout.splitlines()
             if line.startswith("stages/planted.py:")}
    assert found == {(4, "TID251"), (6, "TID251"), (7, "TID251"), (8, "TID251"),
                     (9, "S301"), (10, "S307"), (11, "S302"), (12, "S102")}, flagged.stdout
    for allowed, line in (("stages/run/loading.py", 6), ("stages/export/predict_torch.py", 7)):
        proc = _ruff("--stdin-filename", allowed, "-", stdin=PLANTED)
        lines = {int(found.split(":")[1]) for found in proc.stdout.splitlines()
                 if found.startswith(f"{allowed}:")}
        assert line not in lines and 9 in lines, proc.stdout


# Loader arguments that let a file run code as it loads, whatever function they are passed to.
UNSAFE_KEYWORDS = {"weights_only": False, "allow_pickle": True}


def test_no_call_turns_off_a_loader_s_guard_against_pickles():
    offenders = []
    for path in sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.keyword) and node.arg in UNSAFE_KEYWORDS
                    and not (isinstance(node.value, ast.Constant)
                             and node.value.value != UNSAFE_KEYWORDS[node.arg])):
                offenders.append(f"{path.relative_to(ROOT)}:{node.value.lineno}: "
                                 f"{node.arg}={ast.unparse(node.value)}")
    assert not offenders, offenders

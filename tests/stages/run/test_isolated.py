"""A function in a spawned child (stages/run/isolated.py): its answer, its error and its death
come back to the parent, and it runs with the environment a deployment has."""
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.run import isolated
from stages.run.errors import UsageError


def answer(doing, value):
    doing("answering")
    return {"value": value, "environment": dict(os.environ), "pid": os.getpid()}


def refuse(doing):
    raise UsageError("no such run; give --run NAME")


class TwoArguments(Exception):
    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


def refuse_oddly(doing):
    raise TwoArguments("the model", "too large")


def crash(doing):
    doing("reading address 0")
    ctypes.string_at(0)


def hold_then_die_killed(doing, megabytes):
    held = bytearray(megabytes * 2**20)  # zero pages are not resident until written
    held[::4096] = b"x" * len(held[::4096])
    time.sleep(1.0)  # the parent reads the child's memory every 0.2 s
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_long(doing, pid_file):
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(120)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie no one reaped has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


PARENT = f"""
import sys
from stages.run import isolated
isolated.call("{__name__}:sleep_long", sys.argv[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_when_its_parent_is_killed(tmp_path):
    """SIGKILL of a quantize or report process had left its child running the stage, writing
    the run's manifest with no lock held, beside whatever process took the lock next."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)],
                              cwd=Path(__file__).parents[3])
    deadline = time.monotonic() + 120
    while (not (pid_file.exists() and pid_file.read_text())
           and time.monotonic() < deadline and parent.poll() is None):
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child)


def test_a_child_answers_raises_and_dies_as_the_parent_can_tell():
    got = isolated.call(f"{__name__}:answer", 7, environment={"ONLY": "this"})
    assert got["value"] == 7 and got["environment"]["ONLY"] == "this"
    with pytest.raises(UsageError, match="no such run; give --run NAME") as refused:
        isolated.call(f"{__name__}:refuse")
    assert "in the child process" in "".join(refused.value.__notes__)  # its trace, for --debug
    # One the parent cannot rebuild from its pickle had come back as that TypeError.
    with pytest.raises(RuntimeError, match=r"^TwoArguments: the model: too large\n") as odd:
        isolated.call(f"{__name__}:refuse_oddly")
    assert "in the child process" in "".join(odd.value.__notes__)
    with pytest.raises(isolated.Crashed) as died:
        isolated.call(f"{__name__}:crash")
    assert (died.value.signal_name, died.value.doing) == ("SIGSEGV", "reading address 0")


def test_the_child_serves_the_next_call_and_a_new_one_follows_a_crash_or_another_environment(
        tmp_path, monkeypatch):
    first = isolated.call(f"{__name__}:answer", 1, environment={"ONLY": "this"})
    assert first["pid"] != os.getpid()
    assert isolated.call(f"{__name__}:answer", 2, environment={"ONLY": "this"})["pid"] == \
        first["pid"]
    other = isolated.call(f"{__name__}:answer", 3, environment={"ONLY": "that"})
    assert other["pid"] != first["pid"] and other["environment"]["ONLY"] == "that"
    monkeypatch.chdir(tmp_path)  # a user's model module is imported relative to it
    elsewhere = isolated.call(f"{__name__}:answer", 4, environment={"ONLY": "that"})
    assert elsewhere["pid"] != other["pid"]
    with pytest.raises(isolated.Crashed):
        isolated.call(f"{__name__}:crash", environment={"ONLY": "that"})
    after = isolated.call(f"{__name__}:answer", 5, environment={"ONLY": "that"})
    assert after["value"] == 5 and after["pid"] != elsewhere["pid"]


def test_ctrl_c_leaves_an_idle_child_quiet_and_serving(capfd):
    """Ctrl-C goes to the whole process group: the report's idle child (predict running after
    it in a chain) had printed KeyboardInterrupt's traceback beside the parent's one line."""
    first = isolated.call(f"{__name__}:answer", 1, environment={"ONLY": "ctrl-c"})
    os.kill(first["pid"], signal.SIGINT)
    time.sleep(0.5)
    again = isolated.call(f"{__name__}:answer", 2, environment={"ONLY": "ctrl-c"})
    assert again["pid"] == first["pid"]  # alive, and the parent ends it when it must
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_a_child_runs_without_the_cap_training_set_and_keeps_a_users(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    monkeypatch.setenv(isolated.CAPPED_FOR_TRAINING, "AVX512_CORE_BF16")
    environment = isolated.deployment_environment()
    assert "ONEDNN_MAX_CPU_ISA" not in environment
    assert isolated.CAPPED_FOR_TRAINING not in environment
    assert "ONEDNN_MAX_CPU_ISA" not in isolated.call(f"{__name__}:answer", 0)["environment"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the user's own, set over training's
    assert isolated.deployment_environment()["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    monkeypatch.delenv(isolated.CAPPED_FOR_TRAINING)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # the user's: not training's
    assert isolated.deployment_environment()["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"


def test_a_child_killed_as_the_out_of_memory_killer_kills_is_named_with_the_memory_it_held():
    with pytest.raises(isolated.Crashed) as died:
        isolated.call(f"{__name__}:hold_then_die_killed", 300)
    assert died.value.signal_name == "SIGKILL"
    assert 300 * 2**20 <= died.value.peak_rss_bytes < 2 * 2**30

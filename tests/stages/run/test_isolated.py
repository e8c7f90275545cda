"""A function in a spawned child (stages/run/isolated.py): its answer, its error and its death
come back to the parent, and it runs with the environment a deployment has."""
import ctypes
import os

import pytest

from stages.run import isolated
from stages.run.errors import UsageError


def answer(doing, value):
    doing("answering")
    return {"value": value, "environment": dict(os.environ)}


def refuse(doing):
    raise UsageError("no such run; give --run NAME")


def crash(doing):
    doing("reading address 0")
    ctypes.string_at(0)


def test_a_child_answers_raises_and_dies_as_the_parent_can_tell():
    got = isolated.call(f"{__name__}:answer", 7, environment={"ONLY": "this"})
    assert got["value"] == 7 and got["environment"]["ONLY"] == "this"
    with pytest.raises(UsageError, match="no such run; give --run NAME") as refused:
        isolated.call(f"{__name__}:refuse")
    assert "in the child process" in "".join(refused.value.__notes__)  # its trace, for --debug
    with pytest.raises(isolated.Crashed) as died:
        isolated.call(f"{__name__}:crash")
    assert (died.value.signal_name, died.value.doing) == ("SIGSEGV", "reading address 0")


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

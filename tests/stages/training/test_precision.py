"""The precision policy: what auto picks where, and when oneDNN is capped below AMX."""
import os

import pytest
import torch

from stages.measure import machine
from stages.run.isolated import CAPPED_FOR_TRAINING
from stages.training import precision
from stages.training.precision import Precision, resolve_precision


def _cpu_with(monkeypatch, *flags):
    monkeypatch.setattr(machine, "cpu_info", lambda: {"model": "test", "flags": list(flags),
                                                    "cores": 2})


@pytest.mark.parametrize("flags, picked", [
    (("avx2",), "fp32"),                                   # AMD EPYC here: bf16 is emulated
    (("avx2", "avx512f", "avx512_bf16"), "bf16"),
    (("avx2", "avx512f", "avx512_vnni", "amx_bf16", "amx_int8"), "bf16"),
])
def test_auto_picks_bf16_only_on_cpus_with_bf16_instructions(monkeypatch, flags, picked):
    _cpu_with(monkeypatch, *flags)
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == picked
    note = precision.auto_precision_note(resolve_precision("auto", cpu), "auto", cpu)
    assert (note is not None) == (picked == "fp32")
    assert resolve_precision("auto", torch.device("cuda")).name == "fp16"
    assert resolve_precision("bf16", cpu).name == "bf16"
    assert Precision("fp16").uses_scaler and not Precision("bf16").uses_scaler


@pytest.mark.parametrize("flags, asked, device, capped", [
    (("amx_bf16", "amx_int8"), "bf16", "cpu", True),
    (("amx_bf16", "amx_int8"), "auto", "cpu", True),
    (("amx_bf16", "amx_int8"), "fp32", "cpu", False),
    (("amx_bf16", "amx_int8"), "bf16", "cuda", False),
    (("avx2",), "bf16", "cpu", False),
])
def test_onednn_is_capped_below_amx_only_for_bf16_training_on_amx(monkeypatch, flags, asked,
                                                                  device, capped):
    _cpu_with(monkeypatch, *flags)
    # Set, then removed: monkeypatch restores only what it changed, and a cap the code sets on
    # a machine with none would otherwise reach every later test of this worker.
    for name in ("ONEDNN_MAX_CPU_ISA", CAPPED_FOR_TRAINING):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    result = precision.cap_isa_for_bf16_training(asked, device)
    assert (result == "AVX512_CORE_BF16") == capped
    assert (os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX512_CORE_BF16") == capped
    assert (os.environ.get(CAPPED_FOR_TRAINING) == "AVX512_CORE_BF16") == capped


def test_a_users_own_cap_is_left_alone(monkeypatch):
    _cpu_with(monkeypatch, "amx_bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert precision.cap_isa_for_bf16_training("bf16", "cpu") is None
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"

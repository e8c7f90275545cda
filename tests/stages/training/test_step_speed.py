"""--precision auto on a CPU with bf16 instructions keeps bf16 unless its measured training
step is BF16_SLOWER_BY times fp32's; the choice and the two times are recorded and reported.
Which way a real measurement falls depends on the machine, so the tests move the margin to
either end around a real measurement instead of asserting a timing."""
import math

import pytest
import torch

from pipeline.config import TrainConfig
from stages import report, train
from stages.measure import machine
from stages.report.markdown import amp_sentence
from stages.run import artifacts
from stages.training import step_speed
from stages.training.precision import Precision
from tests.conftest import TINY_TRAIN

MEASURED = "auto, measured: a training step at "


def _train(tmp_path, monkeypatch, slower_by: float, **config):
    """A tiny run trained under --time with --precision auto where auto first resolves to bf16
    (as on a CPU with bf16 instructions), under the margin given."""
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(step_speed, "BF16_SLOWER_BY", slower_by)
    run = artifacts.create_run(tmp_path, "speed")
    results = train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "precision": "auto",
                                                     "time": "60s"} | config), run)
    return {r.variant: r for r in results}, run


def test_amp_trains_in_fp32_where_its_bf16_steps_were_measured_slower(tmp_path, monkeypatch):
    results, run = _train(tmp_path, monkeypatch, slower_by=0.0)  # any bf16 step is too slow
    recorded = run.recorded_config("train")
    assert results["amp"].precision == recorded["resolved_precision"] == "fp32"
    assert recorded["precision_chosen_by"].startswith(MEASURED)
    assert run.entry("fp32")["training"]["same_run_as"] == "amp"  # trained once
    rows = report.training_rows(run)
    sentence = amp_sentence(rows, [{"name": "fp32", "size_bytes": rows["fp32"]["model_bytes"]}])
    assert "`amp` trained in fp32 here (--precision auto measured a training step at " in sentence
    # No int8 row: no float row is credited as quantization's shrinking (it had been, 1.00x).
    assert "quantization would shrink it (no int8 variant was made)" in sentence


def test_bf16_is_kept_within_the_margin_and_the_measurement_recorded(tmp_path, monkeypatch):
    results, run = _train(tmp_path, monkeypatch, slower_by=math.inf)
    assert results["amp"].precision == "bf16" and results["fp32"].precision == "fp32"
    assert "same_run_as" not in run.entry("fp32")["training"]
    assert run.recorded_config("train")["precision_chosen_by"].startswith(MEASURED)
    assert report.training_rows(run)["amp"]["precision_chosen_by"].startswith(MEASURED)


def test_with_fixed_epochs_auto_is_not_timed_and_stays_bf16(monkeypatch):
    """The same seed must give the same weights: without --time the choice is not measured
    (its record reaching config.json and the report: the test above)."""
    def measured(*args):
        raise AssertionError("timed a training step without --time")

    monkeypatch.setattr(step_speed, "step_seconds", measured)
    config = TrainConfig(**TINY_TRAIN | {"precision": "auto"})
    precision, why = step_speed.choose_precision(config, None, Precision("bf16"),
                                                 torch.device("cpu"))
    assert precision == Precision("bf16") and why.startswith("auto (timed against")


@pytest.mark.parametrize("asked", ["bf16", "fp32"])
def test_a_precision_given_is_not_measured(asked, monkeypatch):
    def measured(*args):
        raise AssertionError("timed a precision the user gave")

    monkeypatch.setattr(step_speed, "step_seconds", measured)
    config = TrainConfig(**TINY_TRAIN | {"precision": asked})
    chosen = step_speed.choose_precision(config, None, Precision(asked), torch.device("cpu"))
    assert chosen == (Precision(asked), "--precision")

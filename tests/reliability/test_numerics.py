"""Numerics: NaN losses named with their likely cause, GradScaler's skipped steps through our
own loop, and runs that repeat exactly."""
import pytest
import torch

from pipeline.config import TrainConfig
from stages import train
from stages.run import artifacts, loading
from stages.run.errors import PipelineError
from tests.conftest import TINY_TRAIN, make_cheap_run


def _loss_that(monkeypatch, change, only=None):
    """Replace the loss with one whose value ``change(call_number, loss)`` decides; with
    ``only``, only while training that variant."""
    real = torch.nn.CrossEntropyLoss
    calls = {"n": 0}

    class Loss(real):
        def forward(self, logits, labels):
            calls["n"] += 1
            return change(calls["n"], super().forward(logits, labels))

    monkeypatch.setattr(torch.nn, "CrossEntropyLoss", Loss)
    return calls


def test_a_nan_loss_stops_with_epoch_and_step_and_keeps_checkpoints(tmp_path, monkeypatch):
    run = artifacts.create_run(tmp_path, "nan")
    _loss_that(monkeypatch, lambda n, loss: loss * float("nan") if n == 21 + 3 else loss)
    with pytest.raises(PipelineError, match="loss became NaN or infinite at epoch 2 step 3.*"
                                            "lower --lr"):
        # fp32: auto on a CPU with bf16 instructions would time steps first, counted above
        train.run(TrainConfig(**TINY_TRAIN | {"baseline": False, "precision": "fp32"}), run)
    listed = run.artifacts()
    assert "amp" not in listed and "amp/checkpoint-step0000021" in listed
    assert run.verified_path("amp/checkpoint-step0000021")  # the last good one is intact


def test_a_nan_only_in_mixed_precision_is_not_blamed_on_the_learning_rate(tmp_path,
                                                                          monkeypatch):
    run = artifacts.create_run(tmp_path, "kernel")
    # fp32 trains 42 steps cleanly first; the amp model then goes NaN at its step 5.
    _loss_that(monkeypatch, lambda n, loss: loss * float("nan") if n == 42 + 5 else loss)
    with pytest.raises(PipelineError) as raised:
        train.run(TrainConfig(**TINY_TRAIN | {"precision": "bf16"}), run)
    message = str(raised.value)
    assert "amp: the loss became NaN or infinite at epoch 1 step 5" in message
    assert "not --lr" in message and "--precision fp32" in message
    assert "fp32" in run.artifacts()


BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def test_skipped_fp16_steps_leave_the_weights_and_back_the_scale_off(tmp_path, monkeypatch):
    """Steps 3 and 4 get a loss whose float16 gradients overflow: GradScaler must skip both
    (weights as after step 2), halve the scale twice, and the run must count 2 skips."""
    run = artifacts.create_run(tmp_path, "skips")
    _loss_that(monkeypatch, lambda n, loss: loss * 1e30 if n in (3, 4) else loss)
    (result,) = train.run(TrainConfig(**TINY_TRAIN | {
        "baseline": False, "precision": "fp16", "epochs": 1, "checkpoint_every": 1,
        "keep_checkpoints": 30}), run)
    assert result.skipped_steps == 2 and result.optimizer_steps == 19
    states = {step: loading.load_checkpoint(run.verified_path(f"amp/checkpoint-step{step:07d}"))
              for step in (2, 3, 4, 5)}
    # Weights only: BatchNorm's running statistics follow every forward pass, skipped or not.
    weights = [k for k in states[2]["model"] if not k.endswith(BATCHNORM_BUFFERS)]
    for step in (3, 4):
        assert all(torch.equal(states[2]["model"][k], states[step]["model"][k]) for k in weights)
    assert not all(torch.equal(states[4]["model"][k], states[5]["model"][k]) for k in weights)
    assert states[4]["scaler"]["scale"] == states[2]["scaler"]["scale"] / 4


def test_fp16_stops_after_too_many_skipped_steps_in_a_row(tmp_path, monkeypatch):
    run = artifacts.create_run(tmp_path, "too-many")
    _loss_that(monkeypatch, lambda n, loss: loss * 1e30 if n > 5 else loss)
    with pytest.raises(PipelineError, match="skipped 4 optimizer steps in a row"):
        train.run(TrainConfig(**TINY_TRAIN | {"baseline": False, "precision": "fp16",
                                              "max_skipped_steps": 3}), run)


@pytest.mark.slow
def test_the_same_seed_twice_gives_the_same_weights_predictions_and_report(_cheap_template,
                                                                         tmp_path):
    """Two runs made alike in this process (train, ort-static on seeded calibration images,
    report), the session's template and one made now, after whatever ran in between, hold the
    same weights, the same int8 model to the byte, and the same report figures."""
    import json

    runs = [_cheap_template, artifacts.create_run(tmp_path, "again")]
    make_cheap_run(runs[1])
    for variant in ("fp32", "amp"):
        a = loading.load_checkpoint(runs[0].verified_path(variant))["state_dict"]
        b = loading.load_checkpoint(runs[1].verified_path(variant))["state_dict"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), variant
    assert runs[0].entry("ort-static")["sha256"] == runs[1].entry("ort-static")["sha256"]
    reports = [json.loads(run.verified_path("report/report.json").read_text()) for run in runs]
    figures = [[(m["name"], m["accuracy"], m["agreement"], m["flipped_predictions"],
                 m["validation"]["accuracy"]) for m in r["models"]] for r in reports]
    assert figures[0] == figures[1]


def test_a_baseline_that_stopped_sooner_does_not_clear_the_learning_rate(tmp_path):
    """amp goes NaN in epoch 3 where fp32 stopped after 2 (its plateau or time budget): fp32
    never met that epoch's steps, so the message must not rule --lr out."""
    from types import SimpleNamespace

    from stages.training.failures import nan_message

    bf16, cpu = SimpleNamespace(name="bf16"), SimpleNamespace(type="cpu")
    sooner = nan_message("amp", bf16, cpu, 3, 5, tmp_path, baseline_epochs=2)
    assert "not --lr" not in sooner and "lower --lr" in sooner
    through = nan_message("amp", bf16, cpu, 3, 5, tmp_path, baseline_epochs=3)
    assert "trained through epoch 3" in through and "not --lr" in through

"""Numerics: NaN losses, inf gradients under GradScaler, and runs that repeat exactly."""
import pytest
import torch

from pipeline.config import QuantizeConfig, ReportConfig, TrainConfig
from stages import artifacts, quantize, report, train
from stages.precision import Precision, grad_scaler
from tests.conftest import TINY_REPORT, TINY_TRAIN


def _loss_that(monkeypatch, change):
    """Replace the loss with one whose value ``change(call_number, loss)`` decides."""
    real = torch.nn.CrossEntropyLoss
    calls = {"n": 0}

    class Loss(real):
        def forward(self, logits, labels):
            calls["n"] += 1
            return change(calls["n"], super().forward(logits, labels))

    monkeypatch.setattr(torch.nn, "CrossEntropyLoss", Loss)


def test_a_nan_loss_stops_with_epoch_and_step_and_keeps_checkpoints(tmp_path, monkeypatch):
    from stages.errors import PipelineError

    run = artifacts.create_run(tmp_path, "nan")
    _loss_that(monkeypatch, lambda n, loss: loss * float("nan") if n == 21 + 3 else loss)
    with pytest.raises(PipelineError, match="loss became nan at epoch 2 step 3"):
        train.run(TrainConfig(**TINY_TRAIN | {"baseline": False}), run)
    listed = run.artifacts()
    assert "amp" not in listed and "amp/checkpoint-step0000021" in listed
    assert run.verified_path("amp/checkpoint-step0000021")  # the last good one is intact


def test_fp16_stops_after_too_many_skipped_steps_in_a_row(tmp_path, monkeypatch):
    from stages.errors import PipelineError

    run = artifacts.create_run(tmp_path, "skips")
    # Finite in float32, but its float16 gradients overflow: GradScaler skips every step.
    _loss_that(monkeypatch, lambda n, loss: loss * 1e30 if n > 5 else loss)
    with pytest.raises(PipelineError, match="skipped 4 optimizer steps in a row"):
        train.run(TrainConfig(**TINY_TRAIN | {"baseline": False, "precision": "fp16",
                                              "max_skipped_steps": 3}), run)



def test_fp16_scaler_on_cpu_skips_a_step_with_inf_gradients_and_backs_off():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = grad_scaler(Precision("fp16"), torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    loss = model(torch.tensor([[float("inf"), 1.0, 1.0]])).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == scale * 0.5


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_quantized:
            return torch.equal(a.int_repr(), b.int_repr()) and torch.equal(a.dequantize(),
                                                                          b.dequantize())
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_same_seed_twice_gives_the_same_weights_predictions_and_report(tmp_path):
    reports, runs = [], []
    for name in ("first", "second"):
        run = artifacts.create_run(tmp_path, name)
        train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1}), run)
        quantize.run(QuantizeConfig(methods="torch-static,ort-static", calibration_samples=64,
                                    quiet=True), run)
        reports.append(report.run(ReportConfig(**TINY_REPORT), run))
        runs.append(run)
    for variant in ("fp32", "amp", "torch-static"):
        a = artifacts.load_checkpoint(runs[0].verified_path(variant))["state_dict"]
        b = artifacts.load_checkpoint(runs[1].verified_path(variant))["state_dict"]
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), variant
    figures = [[(m["name"], m["accuracy"], m["agreement"], m["flipped_predictions"], m["top5_accuracy"])
                for m in r["models"]] for r in reports]
    assert figures[0] == figures[1]
    images = train.splits_of_run(runs[0]).test.tensors[0]
    for variant in ("torch-static", "fp32"):
        first = train.predict(quantize.load_torch_model(runs[0], variant), images)
        second = train.predict(quantize.load_torch_model(runs[1], variant), images)
        assert torch.equal(first, second), variant

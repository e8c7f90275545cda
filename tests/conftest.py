"""Shared fixtures: one tiny run (smallcnn on 8x8 digits) trained, quantized, fine-tuned with QAT
and reported once.

bf16 training on a CPU with AMX needs oneDNN capped below AMX before its first kernel (see
stages/precision.py); the CLI does that, and so does this file for tests that train in-process.
"""
from __future__ import annotations

from stages.shared.precision import cap_isa_for_bf16_training

cap_isa_for_bf16_training("bf16", "cpu")  # before any test imports torch and runs a kernel

import pytest  # noqa: E402

from pipeline.config import QatConfig, QuantizeConfig, ReportConfig, TrainConfig  # noqa: E402

TINY_TRAIN = dict(model="smallcnn", image_size=8, epochs=2, batch_size=64, lr=0.05, quiet=True,
                  measure_memory=False)
# Batch 32 is also the batch compiled models score in: one graph each to build.
TINY_REPORT = dict(batch_sizes=(1, 32), warmup=1, rounds=5, max_rounds=5, repeats=4, quiet=True)
ALL_VARIANTS = ["fp32", "amp", "fp32-compiled", "torch-dynamic", "torch-static", "torch-qat",
                "onnx-fp32", "ort-dynamic", "ort-static", "ort-qat", "openvino-fp32",
                "openvino-int8"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A complete run folder of the tiny model with every variant and a report. The amp model
    trains in bf16 whatever the CPU, so that mixed precision is what is tested."""
    from stages import qat, quantize, report, train
    from stages.shared import artifacts

    run = artifacts.create_run(tmp_path_factory.mktemp("artifacts"), "tiny")
    train_results = train.run(TrainConfig(**TINY_TRAIN | {"precision": "bf16",
                                                          "measure_memory": True}), run)
    quantize.run(QuantizeConfig(calibration_samples=128, quiet=True), run)
    qat.run(QatConfig(epochs=1, quiet=True), run)
    report_data = report.run(ReportConfig(**TINY_REPORT), run)
    return {"run": run, "train": {r.variant: r for r in train_results}, "report": report_data}


@pytest.fixture(scope="session")
def _fresh_template(tmp_path_factory):
    from stages import quantize, train
    from stages.shared import artifacts

    run = artifacts.create_run(tmp_path_factory.mktemp("template") / "artifacts", "fresh")
    train.run(TrainConfig(**TINY_TRAIN | {"precision": "fp32"}), run)
    quantize.run(QuantizeConfig(methods="torch-static", calibration_samples=64, quiet=True), run)
    return run


@pytest.fixture
def fresh_tiny_run(_fresh_template, tmp_path):
    """A tiny run of its own (a test may damage it): trained in fp32, quantized with
    torch-static; a copy of one made once per session."""
    import shutil

    from stages.shared import artifacts

    shutil.copytree(_fresh_template.artifacts_dir, tmp_path / "artifacts")
    return artifacts.open_run(tmp_path / "artifacts", "fresh")

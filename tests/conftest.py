"""Shared fixtures: one tiny run (smallcnn on 8x8 digits) trained, quantized and reported once."""
from __future__ import annotations

import pytest

from pipeline.config import QuantizeConfig, ReportConfig, TrainConfig

TINY_TRAIN = dict(model="smallcnn", image_size=8, epochs=2, batch_size=64, quiet=True)
TINY_REPORT = dict(batch_sizes=(1, 4), warmup=1, repeats=3, quiet=True)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A complete run folder of the tiny model with every variant and a report."""
    from stages import artifacts, quantize, report, train

    run = artifacts.create_run(tmp_path_factory.mktemp("artifacts"), "tiny")
    train_results = train.run(TrainConfig(**TINY_TRAIN), run)
    quantize.run(QuantizeConfig(calibration_samples=128, quiet=True), run)
    report_data = report.run(ReportConfig(**TINY_REPORT), run)
    return {"run": run, "train": {r.variant: r for r in train_results}, "report": report_data}


@pytest.fixture
def fresh_tiny_run(tmp_path):
    """A tiny run of its own (a test may damage it): trained, quantized with torch-static."""
    from stages import artifacts, quantize, train

    run = artifacts.create_run(tmp_path / "artifacts", "fresh")
    train.run(TrainConfig(**TINY_TRAIN), run)
    quantize.run(QuantizeConfig(methods="torch-static", calibration_samples=64, quiet=True), run)
    return run

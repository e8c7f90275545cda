"""Shared fixtures, each made once per session and copied where a test may change it:

- tiny_run: smallcnn on 8x8 digits, trained (amp in bf16 beside fp32), every variant quantize
  makes, and a report; the fast tier's one trained run.
- tiny_qat_run: a copy of it fine-tuned by the qat stage and reported again (slow: torchao
  exports some thirty pattern graphs the first time QAT runs in a process).
- cheap_run: a copy of one trained for an epoch in fp32 with ort-static and a report at
  batches 1 and 32, for tests that need a complete run folder and not what is in it.

bf16 training on a CPU with AMX needs oneDNN capped below AMX before its first kernel (see
stages/training/precision.py); the CLI does that, and so does this file for tests that train
in-process.

The suite runs in a process per CPU (pytest-xdist, `-n logical` in pyproject.toml): alone it
kept one of two cores busy on average (the fast tier: 214 s of CPU in 231 s), since most of a
test's time is Python (imports, tracing, exports) on one thread. Each worker runs pinned to
its share of the CPUs (_share_of_the_cpus); the longest tests start first, and the tests of QAT
share one worker (xdist_group "qat"), so that tiny_qat_run and torchao's exports are made once.
"""
from __future__ import annotations

import os

from stages.measure.machine import allowed_cpus, cpu_has_bf16


def _share_of_the_cpus() -> int:
    """Pin this xdist worker to its own slice of the CPUs, inherited by the processes its tests
    start, and return how many: torch, the runtimes (machine.inference_threads) and the timing's
    contention check then see the slice as the machine, so that two workers neither run four
    threads on two cores nor count each other as a busy neighbour."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = allowed_cpus()
    share = len(cpus) // workers
    if workers == 1 or not share or not hasattr(os, "sched_setaffinity"):
        return max(1, share)
    index = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % workers  # a restart: gw2
    os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])
    os.environ["OMP_NUM_THREADS"] = str(share)  # before torch is imported: read once
    return share


THREADS = _share_of_the_cpus()
# A developer's own settings (pipeline --help names these) must not reach the tests' commands.
for _name in ("PIPELINE_CONFIG", "PIPELINE_RUN", "PIPELINE_ARTIFACTS_DIR"):
    os.environ.pop(_name, None)

from stages.training.precision import cap_isa_for_bf16_training  # noqa: E402

cap_isa_for_bf16_training("bf16", "cpu")  # before any test imports torch and runs a kernel

import shutil  # noqa: E402

import pytest  # noqa: E402

from pipeline.config import QatConfig, QuantizeConfig, ReportConfig, TrainConfig  # noqa: E402

TINY_TRAIN = dict(model="smallcnn", image_size=8, epochs=2, batch_size=64, lr=0.05, quiet=True,
                  measure_memory=False)
# Batch 32 alone: it is the batch compiled models score in, so each builds one graph (a
# second batch size costs three more Inductor compiles); cheap_run's report has two sizes.
# One thread: a process on the other core is not "others" to the timing's contention check,
# which would wait for quiet and time again.
TINY_REPORT = dict(batch_sizes=(32,), warmup=1, rounds=5, max_rounds=5, repeats=4, quiet=True,
                   threads=1, time_below_amx=False)  # tested once, in test_report.py
ALL_VARIANTS = ["fp32", "amp", "fp32-compiled", "amp-compiled", "torch-dynamic",
                "torch-static", "torch-qat", "onnx-fp32", "ort-dynamic", "ort-static", "ort-qat",
                "openvino-fp32", "openvino-bf16", "openvino-int8", "openvino-qat"]
QAT_VARIANTS = ("torch-qat", "ort-qat", "openvino-qat")
BF16_VARIANTS = ("amp-compiled", "openvino-bf16")  # made only on a CPU with bf16 instructions
# What quantize is asked to make by default, and what it makes on this CPU (with the models
# train wrote first).
QUANTIZE_METHODS = [n for n in ALL_VARIANTS if n not in QAT_VARIANTS + ("fp32", "amp")]
FROM_QUANTIZE = ["fp32", "amp"] + [n for n in QUANTIZE_METHODS
                                   if n not in BF16_VARIANTS or cpu_has_bf16()]


def pytest_collection_modifyitems(items):
    """The tests marked longest first, the rest in their order: a worker that drew the default
    chain last would run on alone for minutes after the other had finished."""
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)


def _made_once(tmp_path_factory, name: str, make):
    """``make(folder)``'s result, made by the first xdist worker that asks and read from disk
    by the others (pytest-xdist's recipe for a session fixture made once): each worker had
    made tiny_run (62 s of set-up in a --durations run on a 2-core Zen 4) and the templates
    for itself. The
    folder is shared, so a test copies it before changing anything (as it always had to)."""
    import fcntl
    import pickle

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # the session's, above each worker's
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait here while it is made
        made = root / f"{name}.pickle"
        if made.exists():
            return pickle.loads(made.read_bytes())
        shutil.rmtree(root / name, ignore_errors=True)  # a worker's failed try, if any
        (root / name).mkdir()
        result = make(root / name)
        made.write_bytes(pickle.dumps(result))
        return result


def _copy(run, folder):
    from stages.run import artifacts

    shutil.copytree(run.artifacts_dir, folder)
    return artifacts.open_run(folder, run.name)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A complete run folder of the tiny model with every variant quantize makes and a report.
    The amp model trains in bf16 whatever the CPU, so that mixed precision is what is tested."""
    def make(folder):
        from stages import quantize, report, train
        from stages.run import artifacts

        run = artifacts.create_run(folder / "artifacts", "tiny")
        train_results = train.run(TrainConfig(**TINY_TRAIN | {"precision": "bf16"}), run)
        quantize.run(QuantizeConfig(calibration_samples=128, quiet=True), run)
        report_data = report.run(ReportConfig(**TINY_REPORT), run)
        return {"run": run, "train": {r.variant: r for r in train_results},
                "report": report_data}

    return _made_once(tmp_path_factory, "tiny", make)


@pytest.fixture(scope="session")
def tiny_qat_run(tiny_run, tmp_path_factory):
    """tiny_run's copy after `qat` and a new report: torch-qat, maybe ort-qat. Three epochs
    asked, and a --tuning-time that cuts them to the one already run once it is timed."""
    from stages import qat, report

    run = _copy(tiny_run["run"], tmp_path_factory.mktemp("qat") / "artifacts")
    qat.run(QatConfig(epochs=3, tuning_time=1e-3, quiet=True), run)
    return {"run": run, "train": tiny_run["train"],
            "report": report.run(ReportConfig(**TINY_REPORT), run)}


def make_cheap_run(run) -> dict:
    """What cheap_run holds, made in ``run``: smallcnn trained one epoch in fp32, ort-static,
    and a report at batches 1 and 32 (returned)."""
    import torch

    from stages import quantize, report, train

    # Serving in this process sets torch's threads (runtimes/pytorch.py), and weights trained
    # with another count differ in their last bits: test_numerics compares two of these runs.
    torch.set_num_threads(THREADS)
    train.run(TrainConfig(**TINY_TRAIN | {"precision": "fp32", "epochs": 1}), run)
    quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64, quiet=True), run)
    return report.run(ReportConfig(**TINY_REPORT | {"batch_sizes": (1, 32)}), run)


@pytest.fixture(scope="session")
def _cheap_template(tmp_path_factory):
    def make(folder):
        from stages.run import artifacts

        run = artifacts.create_run(folder / "artifacts", "cheap")
        make_cheap_run(run)
        return run

    return _made_once(tmp_path_factory, "cheap", make)


@pytest.fixture
def cheap_run(_cheap_template, tmp_path):
    """A complete run of its own (a test may damage it): smallcnn trained one epoch in fp32,
    ort-static, and a report at batches 1 and 32."""
    return _copy(_cheap_template, tmp_path / "artifacts")


@pytest.fixture(scope="session")
def _fresh_template(tmp_path_factory):
    def make(folder):
        from stages import quantize, train
        from stages.run import artifacts

        run = artifacts.create_run(folder / "artifacts", "fresh")
        train.run(TrainConfig(**TINY_TRAIN | {"precision": "fp32"}), run)
        quantize.run(QuantizeConfig(methods="torch-static", calibration_samples=64,
                                    quiet=True), run)
        return run

    return _made_once(tmp_path_factory, "fresh", make)


@pytest.fixture
def fresh_tiny_run(_fresh_template, tmp_path):
    """A tiny run of its own (a test may damage it): trained in fp32, quantized with
    torch-static; a copy of one made once per session."""
    return _copy(_fresh_template, tmp_path / "artifacts")

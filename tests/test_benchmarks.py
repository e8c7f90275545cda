"""Every benchmark script runs here on a tiny model, so that one that no longer runs fails CI
(train_speed.py once passed --lr's "auto" to SGD, and nothing noticed); all but gpu_checks.py,
which needs a GPU (benchmarks/gpu_checks.py says how a session with one runs it)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=None if env is None else os.environ | env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.longest
def test_the_cheap_benchmarks_run_on_a_tiny_model(cheap_run):
    out = _script("benchmarks/train_speed.py", "--model", "smallcnn", "--epochs", "1",
                  "--precision", "fp32")
    assert "samples/s" in out and "the bare loop" in out
    out = _script("benchmarks/lr_range.py", "--models", "smallcnn", "--steps", "20")
    assert "| smallcnn |" in out
    out = _script("benchmarks/memory_format.py", "--models", "smallcnn", "--sizes", "8",
                  "--batch", "8", "--serve-batches", "2", "--steps", "1")
    assert "| smallcnn | 8 | train step | 8 |" in out
    assert "| smallcnn | 8 | eager forward | 2 |" in out
    out = _script("benchmarks/predict_speed.py", "--artifacts-dir",
                  str(cheap_run.artifacts_dir), "--run", cheap_run.name, "--images", "64")
    assert "predict reaches" in out


@pytest.mark.slow
@pytest.mark.longest
def test_the_timing_benchmarks_run_on_a_tiny_run(cheap_run):
    where = ["--artifacts-dir", str(cheap_run.artifacts_dir), "--run", cheap_run.name]
    out = _script("benchmarks/runtimes.py", *where, "--rounds", "5", "--repeats", "4")
    assert "| ort-static |" in out and "recommended: " in out
    out = _script("benchmarks/isolation.py", *where, "--processes", "1")
    assert "| ort-static |" in out and "largest difference between the report" in out


@pytest.mark.slow
@pytest.mark.longest
@pytest.mark.xdist_group("qat")  # conftest.py: tiny_qat_run once
def test_nncf_qat_benchmark_runs_on_a_tiny_qat_run(tiny_qat_run, tmp_path):
    from tests.conftest import _copy

    run = _copy(tiny_qat_run["run"], tmp_path / "artifacts")
    # NNCF compiles a C++ extension for its fake quantization on first use (17 s alone, 45 s in
    # CI beside the other worker, on every fresh machine) and falls back on torch's own
    # operations where no compiler runs: the script's path is the same either way.
    no_compiler = {"CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    out = _script("benchmarks/nncf_qat.py", "--artifacts-dir", str(run.artifacts_dir), "--run",
                  run.name, "--epochs", "1", "--rounds", "3", env=no_compiler)
    assert "| `nncf-qat` |" in out and "nncf-qat: p50" in out


# What the chain benchmarks' pipeline commands take from PIPELINE_CONFIG beside their own flags:
# the tiny settings of tests/conftest.py (one int8 variant, a short timing).
TINY_CHAIN = """[train]
batch_size = 64
lr = 0.05
measure_memory = false
[quantize]
methods = "ort-static"
calibration_samples = 64
[report]
rounds = 5
max_rounds = 5
repeats = 4
warmup = 1
"""


@pytest.mark.slow
@pytest.mark.longest
def test_the_chain_benchmarks_run_on_a_tiny_model(tmp_path):
    from tests.stages.data.test_datasets import _write_idx

    (tmp_path / "tiny.toml").write_text(TINY_CHAIN)
    env = {"PIPELINE_CONFIG": str(tmp_path / "tiny.toml")}
    where = ["--artifacts-dir", str(tmp_path / "artifacts")]
    out = _script("benchmarks/deploy_size.py", "--models", "smallcnn", "--image-size", "8",
                  *where, env=env)
    row = next(line for line in out.splitlines() if line.startswith("| smallcnn | "))
    assert row.count("(`ort-static`)") == 2, row  # the only int8 variant, at batches 1 and 32
    # deploy_size's run, reused as a trained one (its --dataset and --train-time then unused);
    # --modes auto: the defaults' mode differs only in the flags it passes.
    out = _script("benchmarks/families.py", "--models", "smallcnn", "--modes", "auto", *where,
                  env=env)
    assert "| smallcnn | auto | ort-static | " in out and "smallcnn: training" not in out
    rng = np.random.default_rng(0)
    _write_idx(tmp_path / "letters" / "MNIST" / "raw", "train", 600, rng)
    _write_idx(tmp_path / "letters" / "MNIST" / "raw", "t10k", 100, rng)
    done = subprocess.run(["bash", "benchmarks/equalization.sh", str(tmp_path / "letters"),
                           "smallcnn", str(tmp_path / "equalization")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | env | {"EPOCHS": "1", "PYTHON": sys.executable,
                                                  "METHODS": "ort-static"})  # no compile
    assert done.returncode == 0, done.stderr[-2000:]
    for choice in ("no-equalize", "equalize"):
        assert re.search(rf"^--{choice} +ort-static .* points, logit MSE", done.stdout, re.M)
    assert "torch-static" not in done.stdout

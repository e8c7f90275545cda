"""Real processes: a run killed with SIGKILL mid-epoch and resumed, and torchrun with 2 ranks."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages.run import artifacts, files, loading
from stages.run.checkpoints import weights_digest

ROOT = Path(__file__).resolve().parents[2]
# --lr given: a range test (rate found before the first step) is not what is tested here
TRAIN = ["train", "--model", "smallcnn", "--image-size", "16", "--batch-size", "16", "--epochs",
         "2", "--lr", "0.05", "--no-baseline", "--checkpoint-every", "10", "--deterministic",
         "--no-measure-memory"]


def _pipeline(tmp_path, *args):
    return [sys.executable, "-m", "pipeline", "--artifacts-dir", str(tmp_path), "--quiet", *args]


def _artifacts(tmp_path, run):
    """The manifest's entries; {} only before the run has one (it is written atomically, so a
    manifest that is not whole JSON fails the test)."""
    try:
        text = (tmp_path / "runs" / run / "manifest.json").read_text()
    except FileNotFoundError:
        return {}
    return json.loads(text)["artifacts"]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_ends_bit_identical(tmp_path):
    subprocess.run(_pipeline(tmp_path, "--run", "whole", *TRAIN), check=True, timeout=300)

    proc = subprocess.Popen(_pipeline(tmp_path, "--run", "killed", *TRAIN))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [e.get("step") or 0 for e in _artifacts(tmp_path, "killed").values()]
        if max(steps, default=0) >= 100:  # 81 steps an epoch: we are inside epoch 2
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    listed = _artifacts(tmp_path, "killed")
    assert "amp" not in listed
    for entry in listed.values():  # every listed file is whole
        path = tmp_path / "runs" / "killed" / entry["path"]
        assert files.sha256_file(path) == entry["sha256"]

    # Corrupt the newest checkpoint: resume must fall back to the one before it.
    newest = max((e for e in listed.values() if e.get("step")), key=lambda e: e["step"])
    path = tmp_path / "runs" / "killed" / newest["path"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    resumed = subprocess.run(_pipeline(tmp_path, "--run", "killed", "train", "--resume"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"skipping amp/checkpoint-step{newest['step']:07d}: " in resumed.stderr
    assert "resuming from amp/checkpoint-step" in resumed.stderr

    run_whole = artifacts.open_run(tmp_path, "whole")
    run_killed = artifacts.open_run(tmp_path, "killed")
    whole = loading.load_checkpoint(run_whole.verified_path("amp"))["state_dict"]
    again = loading.load_checkpoint(run_killed.verified_path("amp"))["state_dict"]
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    fields = ("epoch", "loss", "train_accuracy", "val_accuracy")
    history = [[{k: json.loads(line)[k] for k in fields}
                for line in (r.root / "train" / "amp" / "metrics.jsonl").read_text().splitlines()]
               for r in (run_whole, run_killed)]
    assert history[0] == history[1] and len(history[0]) == 2


def test_resume_refuses_new_flags(tmp_path):
    proc = subprocess.run(_pipeline(tmp_path, "train", "--resume", "--lr", "0.1"),
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "drop --lr" in proc.stderr


def test_resume_takes_how_the_data_loads_and_refuses_a_seed_or_a_config_table(tmp_path,
                                                                               monkeypatch):
    """--workers and --loader-timeout are today's on --resume (a dead worker's error says to
    resume with --workers 0, which had been refused); --seed and a --config file's [train]
    table had been dropped without a word."""
    from click.testing import CliRunner

    from pipeline.cli import cli
    from stages import train

    artifacts.create_run(tmp_path, "r")
    got = []
    monkeypatch.setattr(train, "run", lambda config, run, resume, resume_keeps: got.append(
        (config.workers, resume, resume_keeps)) or [])

    def invoke(*args):
        return CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", "r", *args],
                                  prog_name="pipeline")

    resumed = invoke("train", "--resume", "--workers", "0")
    assert resumed.exit_code == 0, resumed.output
    assert got == [(0, True, ("workers",))]
    seeded = invoke("--seed", "3", "train", "--resume")
    assert seeded.exit_code == 2 and "drop --seed" in seeded.stderr
    table = tmp_path / "pipeline.toml"
    table.write_text("[train]\nepochs = 3\nworkers = 0\n")
    configured = invoke("--config", str(table), "train", "--resume")
    assert configured.exit_code == 2
    assert "drop epochs from the [train] table of --config" in configured.stderr
    assert len(got) == 1
    table.write_text("[train]\nloader_timeout = 60.0\n[quantize]\nmethods = \"ort-static\"\n")
    assert invoke("--config", str(table), "train", "--resume").exit_code == 0
    assert got[1] == (0, True, ("loader_timeout",))


@pytest.mark.slow
@pytest.mark.longest
def test_torchrun_two_cpu_ranks(tmp_path):
    """Training on both ranks; quantize and report on rank 0 alone, with the QAT that
    quantize --auto goes on to (a budget of 0 points: post-training int8 always misses it),
    which would otherwise wait in an all_reduce for a rank that has left. (Which stage runs
    on which rank: tests/pipeline/test_chain.py.)"""
    (tmp_path / "pipeline.toml").write_text("[qat]\nepochs = 1\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "-m", "pipeline", "--artifacts-dir", str(tmp_path), "--device", "cpu",
               "--config", str(tmp_path / "pipeline.toml"),
               "--quiet", "train", "--model", "smallcnn", "--image-size", "8",
               "--epochs", "2", "--no-measure-memory", "quantize", "--methods",
               "ort-static", "--calibration-samples", "64", "--auto", "--max-accuracy-drop", "0",
               "report", "--rounds", "5", "--max-rounds", "5", "--repeats", "4",
               "--batch-sizes", "32"]
    env = os.environ | {"PIPELINE_RUN": "ddp"}  # torchrun's parser would take --run
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = artifacts.open_run(tmp_path, "ddp")
    for variant in ("fp32", "amp"):
        training = run.entry(variant)["training"]
        assert training["world_size"] == 2
        model = loading.load_checkpoint(run.verified_path(variant))["state_dict"]
        assert training["weights_sha256_all_ranks"] == weights_digest(model)
        assert training["test_accuracy"] > 0.3
    quantized = run.recorded_config("quantize")  # quantize and report ran once, on rank 0
    assert "ort-static" in quantized["not_kept"]  # nothing is within 0 points at 95%
    assert quantized["auto_verdict"].startswith("no post-training configuration kept")
    assert "torch-qat" in run.artifacts()
    assert proc.stdout.count("report: ") == 1
    assert proc.stdout.count("torch-qat: ") == 1
    printed = [line.split(":")[0] for line in proc.stdout.splitlines()]
    assert (printed.count("fp32"), printed.count("amp")) == (1, 1)  # train's, from rank 0 alone
    for name in run.artifacts():  # the run folder is complete and every file is the listed one
        run.verified_path(name)
    assert run.manifest()["stages"]["report"]["status"] == "complete"


@pytest.mark.slow
def test_when_one_rank_fails_every_rank_exits_non_zero_promptly(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "-m", "pipeline", "--artifacts-dir", str(tmp_path / "artifacts"),
               "--device", "cpu", "--quiet", "train", "--model",
               "tests.pipeline.failing_rank:net",
               "--image-size", "8", "--epochs", "1", "--no-baseline", "--no-measure-memory"]
    env = os.environ | {"PIPELINE_RUN": "fails", "PYTHONPATH": str(ROOT)}
    # Promptly: a rank left waiting in a collective would hang for the process group's 30
    # minutes, past this timeout, which fails the test.
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env,
                          cwd=ROOT)
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stderr
    run = artifacts.open_run(tmp_path / "artifacts", "fails")
    assert run.manifest()["stages"]["train"]["status"] == "failed"

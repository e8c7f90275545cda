"""Kills, dead workers, full disks and concurrent runs: nothing listed is ever half written."""
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.config import TrainConfig
from stages import artifacts, train
from stages.errors import PipelineError
from tests.conftest import TINY_TRAIN

BIG_CHECKPOINTS = ["train", "--model", "resnet18", "--image-size", "8", "--batch-size", "32",
                   "--epochs", "2", "--no-baseline", "--checkpoint-every", "1"]


def _pipeline(tmp_path, *args):
    return [sys.executable, "-m", "pipeline", "--artifacts-dir", str(tmp_path), "--quiet", *args]


def _listed(run_root):
    try:
        return json.loads((run_root / "manifest.json").read_text())["artifacts"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _check_nothing_half_written(run_root):
    for entry in _listed(run_root).values():
        assert artifacts.sha256_file(run_root / entry["path"]) == entry["sha256"], entry["path"]
    for path in (run_root / "train" / "amp").glob("checkpoint-*.pt"):
        artifacts.load_checkpoint(path)  # every file under a real name is whole


def test_sigkill_during_checkpoint_writes_loses_nothing(tmp_path):
    """resnet18 with a checkpoint after every step: most of the time goes to writing 90 MB
    checkpoints, so the kills land in writes; after each, every file is whole and resume works."""
    run_root = tmp_path / "runs" / "kills"
    for attempt, delay in enumerate((0.4, 0.9, 0.2)):
        args = BIG_CHECKPOINTS if attempt == 0 else ["train", "--resume"]
        proc = subprocess.Popen(_pipeline(tmp_path, "--run", "kills", *args))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if any(e.get("step") for e in _listed(run_root).values()):
                break
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _check_nothing_half_written(run_root)
    finished = subprocess.run(_pipeline(tmp_path, "--run", "kills", "train", "--resume"),
                              capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    _check_nothing_half_written(run_root)
    assert not list((run_root / "train" / "amp").glob(".*.tmp"))  # resume cleared leftovers
    assert "amp" in _listed(run_root)


class _Faulty(torch.utils.data.Dataset):
    """Wraps a data set; inside a worker, item ``at`` kills the worker or makes it hang."""

    def __init__(self, inner, at, fault):
        self.inner, self.at, self.fault = inner, at, fault

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is not None and index == self.at:
            if self.fault == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)
        return self.inner[index]


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_dead_or_hung_worker_is_a_clear_error_and_checkpoints_stay(tmp_path, monkeypatch,
                                                                     fault):
    real_load = train.load_splits

    def faulty_splits(config):
        splits = real_load(config)
        sampler = train.EpochSampler(len(splits.train), config.seed)
        sampler.set_epoch(1)
        order = list(sampler)
        splits.train = _Faulty(splits.train, order[10 * 64 + 5], fault)  # epoch 1, step 11
        return splits

    monkeypatch.setattr(train, "load_splits", faulty_splits)
    run = artifacts.create_run(tmp_path, "workers")
    config = TrainConfig(**TINY_TRAIN | {"baseline": False, "workers": 1, "loader_timeout": 2,
                                         "checkpoint_every": 5})
    # The loader notices a death by signal, a hang by its timeout: a step or two either way.
    with pytest.raises(PipelineError, match=r"DataLoader worker died or hung at epoch 1 step "
                                            r"(9|10|11|12)\b.*are intact"):
        train.run(config, run)
    assert run.verified_path("amp/checkpoint-step0000005")  # written before; still whole
    assert "amp" not in run.artifacts()


def test_an_artifacts_path_that_cannot_hold_runs_is_a_clear_error(tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(in_the_way), *TINY_CLI])
    assert result.exit_code in (1, 2)
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("pipeline: error:") and str(in_the_way) in line


TINY_CLI = ["--quiet", "train", "--model", "smallcnn", "--image-size", "8", "--epochs", "1"]


def test_a_full_disk_fails_at_the_write_and_marks_the_stage_failed(tmp_path, monkeypatch):
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            real_save(obj, f, *args, **kwargs)  # a partial file, as a full disk leaves it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", "full",
                                      *TINY_CLI])
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "failed: No space left on device" in line and "nothing was written" in line
    run = artifacts.open_run(tmp_path, "full")
    assert run.manifest()["stages"]["train"]["status"] == "failed"
    _check_nothing_half_written(run.root)
    assert not [p for p in run.root.rglob("*.tmp")]


def test_two_runs_started_at_once_keep_apart(tmp_path):
    procs = [subprocess.Popen(_pipeline(tmp_path, *TINY_CLI[1:]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-1000:]
    runs = artifacts.list_runs(tmp_path)
    assert len(runs) == 2
    for name in runs:
        run = artifacts.open_run(tmp_path, name)
        assert run.manifest()["stages"]["train"]["status"] == "complete"
        assert {"fp32", "amp"} <= set(run.artifacts())
    assert (tmp_path / "latest").read_text().strip() in runs

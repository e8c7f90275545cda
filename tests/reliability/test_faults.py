"""Kills, dead workers, full disks and concurrent runs: nothing listed is ever half written."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from pipeline import cli as cli_module
from pipeline.cli import cli
from pipeline.config import TrainConfig
from stages import train
from stages.run import artifacts, files, loading, signals
from stages.run.errors import PipelineError
from stages.training import failures
from stages.training.loop import Position
from tests.conftest import TINY_TRAIN

# 94 MB checkpoints after every one of 12 cheap steps: nearly all the time goes to writing them.
BIG_CHECKPOINTS = ["train", "--model", "tests.reliability.big_weights:wide", "--image-size", "8",
                   "--batch-size", "128", "--epochs", "1", "--no-baseline", "--precision", "fp32",
                   "--lr", "0.01", "--checkpoint-every", "1", "--keep-checkpoints", "2",
                   "--no-measure-memory"]
ROOT = Path(__file__).resolve().parents[2]
TINY_CLI = ["--quiet", "train", "--model", "smallcnn", "--image-size", "8", "--epochs", "1",
            "--no-measure-memory"]


def _pipeline(tmp_path, *args):
    return [sys.executable, "-m", "pipeline", "--artifacts-dir", str(tmp_path), "--quiet", *args]


def _listed(run_root):
    """The manifest's entries; {} only before the run has one. A manifest that is not whole
    JSON fails the test: it is written atomically, so no fault may leave it half written."""
    try:
        text = (run_root / "manifest.json").read_text()
    except FileNotFoundError:
        return {}
    return json.loads(text)["artifacts"]


def _check_nothing_half_written(run_root):
    for entry in _listed(run_root).values():
        assert files.sha256_file(run_root / entry["path"]) == entry["sha256"], entry["path"]
    for path in (run_root / "train" / "amp").glob("checkpoint-*.pt"):
        loading.load_checkpoint(path)  # every file under a real name is whole


def _kill_inside_a_write(proc, folder, deadline):
    """SIGKILL the moment a temporary checkpoint file is being written; True if it was."""
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in folder.glob(".checkpoint-*.tmp") if p.stat().st_size > 1 << 20]
        if partial:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    return False


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_loses_nothing(tmp_path):
    """Three kills, each while a checkpoint is half written (its temporary file on disk, over
    1 MB and growing); after each, every listed file is whole and --resume goes on."""
    run_root = tmp_path / "runs" / "kills"
    folder = run_root / "train" / "amp"
    for attempt in range(3):
        args = BIG_CHECKPOINTS if attempt == 0 else ["train", "--resume"]
        proc = subprocess.Popen(_pipeline(tmp_path, "--run", "kills", *args),
                                stderr=subprocess.PIPE)
        landed = _kill_inside_a_write(proc, folder, time.monotonic() + 240)
        assert landed, f"attempt {attempt}: no kill landed inside a write"
        assert proc.returncode == -signal.SIGKILL
        assert list(folder.glob(".checkpoint-*.tmp"))  # the half-written file, not renamed
        _check_nothing_half_written(run_root)
    finished = subprocess.run(_pipeline(tmp_path, "--run", "kills", "train", "--resume"),
                              capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    _check_nothing_half_written(run_root)
    assert not list(folder.glob(".*.tmp"))  # resume cleared leftovers
    assert "amp" in _listed(run_root)


# Runs in a process of its own, as a user's failed run does: torch's DataLoader leaves its
# SIGCHLD handler installed after a worker dies, and a later torch.compile in the same process
# (Inductor starts compile workers) then crashed the test process here.
FAULTY_WORKER = '''
import os, signal, sys, time
import torch
from pipeline.config import TrainConfig
from stages.run import artifacts
from stages import train
from stages.data.loaders import EpochSampler
from stages.run.errors import PipelineError
from tests.conftest import TINY_TRAIN

class Faulty(torch.utils.data.Dataset):
    """Wraps a data set; inside a worker, item `at` kills the worker or makes it hang."""
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

real_load = train.load_splits
def faulty_splits(config, *args):
    splits = real_load(config, *args)
    sampler = EpochSampler(len(splits.train), config.seed)
    sampler.set_epoch(1)
    order = list(sampler)
    splits.train = Faulty(splits.train, order[10 * 64 + 5], sys.argv[2])  # epoch 1, step 11
    return splits

train.load_splits = faulty_splits
run = artifacts.create_run(sys.argv[1], "workers")
config = TrainConfig(**TINY_TRAIN | {"baseline": False, "workers": 1, "loader_timeout": 2,
                                     "checkpoint_every": 5})
try:
    train.run(config, run)
except PipelineError as exc:
    print(exc)
    sys.exit(3)
'''


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_dead_or_hung_worker_is_a_clear_error_and_checkpoints_stay(tmp_path, fault):
    proc = subprocess.run([sys.executable, "-c", FAULTY_WORKER, str(tmp_path), fault],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 3, proc.stderr[-2000:]
    # The loader notices a death by signal, a hang by its timeout: a step or two either way.
    assert re.search(r"DataLoader worker died or hung at epoch 1 step (9|10|11|12)\b.*are intact",
                     proc.stdout), proc.stdout
    run = artifacts.open_run(tmp_path, "workers")
    # Written before the fault and still whole: it matches its sha256, loads, and is step 5's.
    state = loading.load_checkpoint(run.verified_path("amp/checkpoint-step0000005"))
    assert state["position"]["global_step"] == 5
    assert "amp" not in run.artifacts()


def test_a_worker_death_seen_twice_is_still_one_clear_error(tmp_path, monkeypatch):
    """The CI race: a killed worker broke the pipe (ConnectionResetError), and its SIGCHLD's
    handler raised torch's RuntimeError again while the first was being handled, before the
    workers were shut down. Here the first shutdown is cut short the same way."""
    calls = []

    def cut_short_once(data_iterator):
        calls.append(data_iterator)
        if len(calls) == 1:
            raise RuntimeError("DataLoader worker (pid 17375) is killed by signal: Killed. ")

    monkeypatch.setattr(failures, "stop_workers", cut_short_once)
    dead = SimpleNamespace(is_alive=lambda: False)
    loader = SimpleNamespace(_shutdown_workers=lambda: None, _workers=[dead])
    with pytest.raises(PipelineError, match=r"^amp: a DataLoader worker died or hung at epoch 2 "
                       r"step 4 \(\[Errno 104\] Connection reset by peer\)"):
        with failures.worker_failures("amp", 2, Position(step_in_epoch=3), tmp_path, loader):
            raise ConnectionResetError(104, "Connection reset by peer")
    assert calls == [loader, loader]
    with pytest.raises(ValueError, match="not the loader's"):  # other errors pass untouched
        with failures.worker_failures("amp", 2, Position(step_in_epoch=3), tmp_path, loader):
            raise ValueError("not the loader's")
    # The death's SIGCHLD can also arrive while the dying worker is waited for (a CI run).
    def join_interrupted(timeout):
        raise RuntimeError("DataLoader worker (pid 22297) is killed by signal: Killed. ")

    dying = SimpleNamespace(_shutdown_workers=lambda: None,
                            _workers=[SimpleNamespace(join=join_interrupted,
                                                      is_alive=lambda: True)])
    with pytest.raises(PipelineError, match=r"^amp: a DataLoader worker died or hung"):
        with failures.worker_failures("amp", 2, Position(step_in_epoch=3), tmp_path, dying):
            raise ConnectionResetError(104, "Connection reset by peer")
    # A broken connection where every worker is alive, or with no workers at all, is the
    # dataset's own (a network read), not a worker's death.
    alive = SimpleNamespace(_shutdown_workers=lambda: None,
                            _workers=[SimpleNamespace(is_alive=lambda: True)])
    for iterator in (alive, iter([])):
        with pytest.raises(ConnectionResetError, match="the data server"):
            with failures.worker_failures("amp", 2, Position(step_in_epoch=3), tmp_path, iterator):
                raise ConnectionResetError(104, "the data server reset the connection")


def test_an_artifacts_path_that_cannot_hold_runs_is_a_clear_error(tmp_path, monkeypatch):
    """A file where the folder should be, and a folder whose writes fail with EROFS as a
    read-only mount's do (the tests run as root, whom file modes do not stop)."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(in_the_way), *TINY_CLI])
    assert result.exit_code == 2  # the flag names a file: a usage error
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("pipeline: error:") and str(in_the_way) in line

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(read_only)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(read_only), *TINY_CLI])
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "Read-only file system" in line and str(read_only) in line
    assert list(read_only.iterdir()) == []


def test_a_disk_that_fails_every_write_marks_the_stage_failed(tmp_path, monkeypatch):
    """Once the stage is running, every new file fails with ENOSPC, the manifest's included:
    the stage still ends `failed` (written over the manifest's own bytes), never `running`."""
    failing = {"on": False}
    real_mark, real_mkstemp = artifacts.Run.mark_stage, files.tempfile.mkstemp

    def mark_stage(self, stage, status, detail=None, seconds=None):
        real_mark(self, stage, status, detail, seconds)
        failing["on"] = failing["on"] or status == "running"

    def mkstemp(*args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(artifacts.Run, "mark_stage", mark_stage)
    monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", "full",
                                      *TINY_CLI])
    line = result.stderr.strip().splitlines()[-1]
    assert result.exit_code == 1
    assert "No space left on device" in line and "MB free in" in line
    run = artifacts.open_run(tmp_path, "full")
    assert run.manifest()["stages"]["train"]["status"] == "failed"
    assert "No space left on device" in run.manifest()["stages"]["train"]["error"]
    _check_nothing_half_written(run.root)
    assert not [p for p in run.root.rglob("*.tmp")]


def test_an_export_is_on_disk_before_it_is_said_to_be_done(cheap_run, tmp_path, monkeypatch):
    """Each exported file and the folder that receives it fsynced: a power cut after "export:
    PATH" had been able to leave empty files (predict.py would refuse them, but the export was
    lost)."""
    real_fsync, synced = os.fsync, []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(cheap_run.artifacts_dir), "export",
                                      "--variant", "ort-static", str(tmp_path / "out")])
    assert result.exit_code == 0, result.stderr
    names = {Path(path).name for path in synced}
    assert {p.name for p in (tmp_path / "out").iterdir()} <= names
    assert str(tmp_path) in synced  # the folder it was renamed into


def test_a_variant_made_again_while_it_is_exported_is_not_exported(cheap_run, tmp_path,
                                                                   monkeypatch):
    """Export takes no lock: a quantize writing the variant between export's check and its
    copy had given a folder whose manifest hashed whatever was copied."""
    from stages import export

    real_copy = export.shutil.copyfile

    def copy_of_a_newer_file(source, target):
        real_copy(source, target)
        if str(target).endswith("model.onnx"):
            with open(target, "ab") as file:
                file.write(b"made again")

    monkeypatch.setattr(export.shutil, "copyfile", copy_of_a_newer_file)
    out = tmp_path / "new" / "a" / "out"
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(cheap_run.artifacts_dir), "export",
                                      "--variant", "ort-static", str(out)])
    assert result.exit_code == 1
    assert "changed while it was exported (made again by another quantize?); export it again" \
        in result.stderr
    # Nothing left: not the folder, nor the parents the export made for it (new/a had stayed).
    assert not (tmp_path / "new").exists()


def test_what_a_killed_export_left_in_an_empty_out_dir_is_named(tmp_path):
    """A SIGKILL while exporting into an empty folder (".", a mount point) leaves its hidden
    scratch folder there: the next export had said OUT_DIR "already exists and is not an empty
    folder" of a folder ls shows empty."""
    from stages.export import check_out_dir
    from stages.run.errors import UsageError

    (tmp_path / "out" / ".out.k2v_x9q1" / "export").mkdir(parents=True)
    with pytest.raises(UsageError) as left:
        check_out_dir(tmp_path / "out")
    assert str(left.value) == (f"{tmp_path / 'out'} holds only .out.k2v_x9q1, left by an export "
                               "that did not finish; remove it and export again")
    (tmp_path / "out" / ".cache").mkdir()  # a user's own: not taken for one
    with pytest.raises(UsageError, match="already exists and is not an empty folder"):
        check_out_dir(tmp_path / "out")
    # A mkdir stopped part way: what it made goes, what it never made is passed over.
    from stages.export import _remove_made

    (tmp_path / "new").mkdir()
    _remove_made([tmp_path / "new", tmp_path / "new" / "never"])
    assert not (tmp_path / "new").exists()


def test_a_disk_that_fills_at_the_stages_last_status_write_marks_it_failed(tmp_path,
                                                                          monkeypatch):
    """Everything the stage wrote is on disk, and the write that says `complete` fails: the
    stage had stayed `running` for good, since only a failure is written over the manifest."""
    real_write = artifacts.atomic_write_text

    def write_text(path, text):
        if '"complete"' in text:
            raise files.PipelineError(f"{path}: No space left on device")
        real_write(path, text)

    monkeypatch.setattr(artifacts, "atomic_write_text", write_text)
    # The chain writes the status, whatever the stage did: no training needed.
    monkeypatch.setattr(train, "run", lambda *args, **kwargs: [])
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", "full",
                                      *TINY_CLI])
    assert result.exit_code == 1
    stage = artifacts.open_run(tmp_path, "full").manifest()["stages"]["train"]
    assert stage["status"] == "failed" and "No space left on device" in stage["error"]


REAL_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead of dying
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.argv = ["pipeline"] + sys.argv[2:]
from pipeline.cli import main
main()
"""


def _limited(tmp_path, limit: int, *args):
    return subprocess.run([sys.executable, "-c", REAL_LIMIT, str(limit), "--artifacts-dir",
                           str(tmp_path), "--quiet", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_write_the_operating_system_refuses_is_named_with_what_to_do(tmp_path):
    """A file size limit makes the kernel refuse writes past it (EFBIG), as a full disk
    refuses them (ENOSPC): the checkpoint, then the ONNX file, fail for real."""
    proc = _limited(tmp_path, 150_000, "--run", "limited", "train", "--model", "smallcnn",
                    "--image-size", "8", "--epochs", "1", "--no-baseline")
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("pipeline: error: writing ") and "checkpoint-step" in line
    assert "File too large" in line and "file size limit of this process is 0.15 MB" in line
    assert "nothing was written under that name" in line
    run = artifacts.open_run(tmp_path, "limited")
    assert run.manifest()["stages"]["train"]["status"] == "failed"
    _check_nothing_half_written(run.root)
    assert not list(run.root.rglob("*.tmp"))

    run = artifacts.create_run(tmp_path, "onnx")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "baseline": False}), run)
    size = run.manifest_path.stat().st_size + 8192
    proc = _limited(tmp_path, size, "--run", "onnx", "quantize", "--methods", "onnx-fp32")
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    # The exporter keeps no errno, only how many bytes it wrote: said as a short write.
    assert line.startswith("pipeline: error: writing ") and "model.onnx failed" in line
    assert "File too large" in line or "fewer bytes than were written" in line
    assert run.manifest()["stages"]["quantize"]["status"] == "failed"
    assert "onnx-fp32" not in run.artifacts()
    assert not (run.root / "quantize" / "model.onnx").exists()


def test_a_checkpoint_that_cannot_fit_is_refused_before_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(files.shutil, "disk_usage",
                        lambda path: type("Usage", (), {"free": 5 << 20})())
    with pytest.raises(PipelineError, match=r"not enough space in .* for model.pt: 5.24 MB free, "
                                            r"it needs about 45 MB"):
        files.atomic_torch_save({"w": torch.zeros(11_175_000)}, tmp_path / "model.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_runs_started_at_once_in_the_same_second_keep_apart(tmp_path):
    """Two processes ask for the same timestamp name at once (the clock is frozen for them):
    one gets it, the other a suffixed one; neither overwrites the other. (A whole chain on a
    run create_run made: every chain test.)"""
    frozen = ("import sys, time\n"
              "from stages.run import artifacts\n"
              "artifacts.timestamp_name = lambda: '20261130-120000'\n"
              "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
              "print(artifacts.create_run(sys.argv[1]).name)\n")
    start = str(time.time() + 2)  # both past their imports, then at the same moment
    procs = [subprocess.Popen([sys.executable, "-c", frozen, str(tmp_path), start], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    names = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-1000:]
        names.append(out.strip())
    assert sorted(names) == ["20261130-120000", "20261130-120000-2"]
    assert sorted(artifacts.list_runs(tmp_path)) == sorted(names)
    for name in names:  # each its own manifest, naming itself
        assert artifacts.open_run(tmp_path, name).manifest()["run"] == name
    assert (tmp_path / "latest").read_text().strip() in names


@pytest.mark.slow
def test_sigterm_marks_the_stage_failed_and_loses_nothing(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one fails, and so does a user's kill:
    the stage is marked failed (not left 'running') and every listed file is whole."""
    run_root = tmp_path / "runs" / "terms"
    proc = subprocess.Popen(_pipeline(tmp_path, "--run", "terms", "train", "--model", "smallcnn",
                                      "--image-size", "8", "--epochs", "20", "--no-baseline",
                                      "--no-measure-memory", "--checkpoint-every", "1"),
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not any(name.startswith("amp/checkpoint-step") for name in _listed(run_root)):
        assert proc.poll() is None and time.monotonic() < deadline, "training never checkpointed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr.decode()[-1000:]
    manifest = json.loads((run_root / "manifest.json").read_text())
    assert manifest["stages"]["train"]["status"] == "failed"
    assert manifest["stages"]["train"]["error"].startswith("SystemExit: 143")
    _check_nothing_half_written(run_root)


def _check_training_fails_under_sigterm(tmp_path, monkeypatch, name: str) -> None:
    """Run train through the CLI with SIGTERM's handler installed, training raising: the
    stage must end `failed` with training's error, and the process with SIGTERM's code."""
    def broken_training(*args, **kwargs):
        raise RuntimeError("training broke")

    monkeypatch.setattr(train, "run", broken_training)
    pytest_handler = signal.getsignal(signal.SIGTERM)
    cli_module._fail_stage_on_sigterm()
    try:
        result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", name,
                                          *TINY_CLI])
    finally:
        signal.signal(signal.SIGTERM, pytest_handler)
    assert result.exit_code == 128 + signal.SIGTERM
    stage = artifacts.open_run(tmp_path, name).manifest()["stages"]["train"]
    assert stage["status"] == "failed"
    assert stage["error"] == "RuntimeError: training broke"


def test_a_sigterm_while_the_failure_is_written_waits_for_it(tmp_path, monkeypatch):
    """torchrun's SIGTERM can reach a rank while it records its own failure (it did in CI, and
    the stage stayed `running`): the signal is held until the manifest says `failed`, and then
    still ends the process with SIGTERM's code."""
    real_write = artifacts.atomic_write_text

    def write_text(path, text):
        if '"failed"' in text:
            signal.raise_signal(signal.SIGTERM)  # its handler runs at the next line of Python
        real_write(path, text)

    monkeypatch.setattr(artifacts, "atomic_write_text", write_text)
    _check_training_fails_under_sigterm(tmp_path, monkeypatch, "held")


def test_a_sigterm_just_after_the_error_still_leaves_the_stage_failed(tmp_path, monkeypatch):
    """The CI case the test above did not catch: torchrun's SIGTERM lands with the error that
    made the rank fail, and its handler raises before the failure write holds signals back."""
    real_deferred = signals.deferred
    signalled = []

    def deferred(*numbers):
        if isinstance(sys.exc_info()[1], RuntimeError) and not signalled:  # the failure write
            signalled.append(True)
            signal.raise_signal(signal.SIGTERM)  # its handler raises SystemExit here
        return real_deferred(*numbers)

    monkeypatch.setattr(signals, "deferred", deferred)
    _check_training_fails_under_sigterm(tmp_path, monkeypatch, "early")


def test_a_run_in_use_by_another_process_is_refused_until_that_process_dies(tmp_path):
    """Two processes on one run would each write the manifest back over the other's entries:
    the second is refused before it starts, and a holder killed with SIGKILL frees the run, a
    child it forked (a DataLoader worker, which outlives it a while) notwithstanding."""
    run = artifacts.create_run(tmp_path, "busy")
    manifest = run.manifest_path.read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time\nfrom stages.run import artifacts, lock\n"
         f"run = artifacts.open_run({str(tmp_path)!r}, 'busy')\n"
         "with lock.hold_run(run, 'train quantize'):\n"
         "    if os.fork() == 0:\n        time.sleep(120)\n        os._exit(0)\n"
         "    print('held', flush=True)\n    time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
        start_new_session=True)  # its forked child in its group, killed with it below
    try:
        assert holder.stdout.readline().strip() == "held"
        result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", "busy",
                                          "report"])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert lines == [f"pipeline: error: run 'busy' is in use by another pipeline process "
                         f"(pid {holder.pid}: train quantize); wait for it to end, or give "
                         "another --run"], result.stderr
        assert run.manifest_path.read_bytes() == manifest  # no stage marked, nothing written
        holder.kill()
        holder.wait()
        result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path), "--run", "busy",
                                          "report"])
        assert "in use" not in result.stderr  # the kernel let go of the dead holder's lock
        assert "report" in run.manifest()["stages"]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the forked child, still asleep
        holder.wait()


def test_an_interrupt_while_a_variant_made_again_is_listed_leaves_it_listed(fresh_tiny_run,
                                                                             monkeypatch):
    """The new file replaced the listed one before the manifest was written (hashing a large
    file takes a while): Ctrl-C in between left a run the report refused whole. The move and
    the listing are one step now, the interrupt delivered after it."""
    from pipeline.config import QuantizeConfig
    from stages.runtimes.context import context

    run = fresh_tiny_run
    listed = run.root / run.entry("torch-static")["path"]
    real_record, interrupted = artifacts.Run._file_record, []

    def record_then_interrupt(self, path):
        if not interrupted:
            interrupted.append(path)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the new file is hashed
        return real_record(self, path)

    monkeypatch.setattr(artifacts.Run, "_file_record", record_then_interrupt)
    with context(run, QuantizeConfig(calibration_samples=64, quiet=True), "quantize",
                 record=False) as ctx:
        (ctx.folder / listed.name).write_bytes(b"made again")
        with pytest.raises(KeyboardInterrupt):
            ctx.register("torch-static", ctx.folder / listed.name, {}, "pt2",
                         {"Conv": {"int8": 1, "float": 0}})
    assert interrupted and run.verified_path("torch-static").read_bytes() == b"made again"

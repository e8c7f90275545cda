import errno
import importlib.metadata
import json
import os
import pickle
import stat
import subprocess
import sys

import pytest
import torch

from stages.run import artifacts
from stages.run.errors import PipelineError, UsageError


def test_atomic_write_keeps_old_file_when_the_write_fails(tmp_path):
    target = tmp_path / "data.txt"
    artifacts.atomic_write_text(target, "old")

    def explode(f):
        f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        artifacts.atomic_write(target, explode, mode="w")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["data.txt"]  # no temporary file left


def test_a_sigterm_during_a_write_waits_for_the_file(tmp_path):
    """A kill while a checkpoint is written ends the process after the file is whole. In a
    process of its own, with the CLI's handler: raised in the test process after the ONNX
    Runtime and OpenVINO tests, SIGTERM crashed it (segmentation fault)."""
    target = tmp_path / "checkpoint.pt"
    script = f"""
import signal
from pipeline.cli import _fail_stage_on_sigterm
from stages.run import artifacts
_fail_stage_on_sigterm()
def write(f):
    f.write(b"first half ")
    signal.raise_signal(signal.SIGTERM)  # its handler runs at the next line of Python
    f.write(b"second half")
artifacts.atomic_write({str(target)!r}, write)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 143, proc.stderr[-1000:]
    assert target.read_bytes() == b"first half second half"


def test_a_stop_inside_a_tools_writer_is_not_taken_for_a_full_disk(tmp_path):
    """A signal that interrupts a write system call runs its handler inside the write; torch's
    zip writer then raises RuntimeError 'unexpected pos' over the handler's SystemExit, and
    'unexpected pos' also stands for a short write. The SystemExit is what ends the process,
    not a disk-full message and exit 1. (Raised here as torch raises it: driving torch's C++
    writer into that state in the test process crashed a later test.)"""
    target = tmp_path / "checkpoint.pt"
    with pytest.raises(SystemExit) as stopped:
        with artifacts.atomic_path(target) as tmp:
            tmp.write_bytes(b"half a checkpoint")
            try:
                raise SystemExit(143)  # what the SIGTERM handler raises inside the write
            except SystemExit:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . "
                                   "unexpected pos 46 vs 0")
    assert stopped.value.code == 143
    assert not target.exists() and list(tmp_path.glob(".checkpoint.pt.*")) == []


def test_register_records_sha256_and_verified_path_catches_a_flipped_bit(tmp_path):
    run = artifacts.create_run(tmp_path, "r1")
    path = run.root / "weights.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    entry = run.register("weights", path, kind="model", stage="test")
    assert entry["bytes"] == path.stat().st_size
    assert entry["sha256"] == artifacts.sha256_file(path)
    assert run.verified_path("weights") == path

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match="weights: .* sha256"):
        run.verified_path("weights")


def test_load_checkpoint_refuses_code_in_a_pickle(tmp_path):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": Payload()}, f)
    with pytest.raises(PipelineError) as refused:
        artifacts.load_checkpoint(path)
    assert str(refused.value) == (f"{path} was refused: loading it would run code from the file; "
                                  "save the weights alone (torch.save(model.state_dict(), path)) "
                                  "and give that file")
    assert not marker.exists()


@pytest.mark.parametrize("content, says", [
    (b"root:x:0:0:root:/root:/bin/bash\n", "is not a PyTorch weights file (neither torch.save's "
                                            "zip archive nor a pickle)"),
    (b"", "is empty: it is not a weights file"),
    (b"PK\x03\x04" + b"\0" * 64, "cannot load"),
])
def test_a_file_that_is_not_weights_says_what_it_is_not(tmp_path, content, says):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(PipelineError) as refused:
        artifacts.load_checkpoint(path)
    assert str(path) in str(refused.value) and says in str(refused.value)


def test_runs_latest_pointer_and_errors_that_name_the_runs(tmp_path):
    first = artifacts.create_run(tmp_path, "first")
    second = artifacts.create_run(tmp_path, "second")
    assert (tmp_path / "latest").read_text().strip() == "second"
    assert artifacts.open_run(tmp_path).name == "second"
    assert artifacts.open_run(tmp_path, "first").root == first.root
    with pytest.raises(UsageError, match="'nope' does not exist.*first, second"):
        artifacts.open_run(tmp_path, "nope")
    with pytest.raises(UsageError, match="already exists"):
        artifacts.create_run(tmp_path, "first")
    with pytest.raises(UsageError, match="not allowed"):
        artifacts.create_run(tmp_path, "../escape")
    manifest = json.loads(second.manifest_path.read_text())
    assert manifest["artifacts"] == {}
    assert manifest["versions"]["torch"] == importlib.metadata.version("torch")


@pytest.mark.parametrize("relative", ["../../../elsewhere/outside.pt", "/etc/hostname", "",
                                      "a/../../b"])
def test_a_manifest_path_outside_the_run_is_refused_by_name(tmp_path, relative):
    run = artifacts.create_run(tmp_path, "r1")
    path = run.root / "weights.pt"
    torch.save({"w": torch.arange(10.0)}, path)
    run.register("weights", path, kind="model", stage="test")
    manifest = json.loads(run.manifest_path.read_text())
    manifest["artifacts"]["weights"]["path"] = relative
    run.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match="entry 'weights' points outside the run folder"):
        run.verified_path("weights")
    run.unregister("weights")  # drops the entry, deletes nothing outside
    assert path.exists() and "weights" not in run.artifacts()


def test_a_symlink_leaving_the_run_is_refused(tmp_path):
    run = artifacts.create_run(tmp_path, "r1")
    outside = tmp_path / "outside.pt"
    torch.save({"w": torch.arange(10.0)}, outside)
    (run.root / "link.pt").symlink_to(outside)
    run.register("weights", run.root / "link.pt", kind="model", stage="test")
    with pytest.raises(PipelineError, match="'weights' .* link that leaves the run folder"):
        run.verified_path("weights")


def test_companion_files_are_listed_and_checked(tmp_path):
    run = artifacts.create_run(tmp_path, "r1")
    xml, weights = run.root / "m.xml", run.root / "m.bin"
    xml.write_text("<net/>")
    weights.write_bytes(b"\0" * 1000)
    run.register("pair", xml, kind="model", stage="test", companions=(weights,))
    assert run.shipped_bytes("pair") == xml.stat().st_size + 1000
    assert run.verified_path("pair") == xml
    weights.write_bytes(b"\1" * 1000)
    with pytest.raises(PipelineError, match=r"pair: .*m\.bin does not match its sha256"):
        run.verified_path("pair")
    run.unregister("pair")
    assert not xml.exists() and not weights.exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        artifacts.atomic_write_text(tmp_path / "report.md", "x")
        artifacts.atomic_torch_save({"w": torch.zeros(3)}, tmp_path / "model.pt")
    finally:
        os.umask(old)
    for name in ("report.md", "model.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_a_failed_stage_is_written_over_the_manifest_when_no_new_file_fits(tmp_path, monkeypatch):
    run = artifacts.create_run(tmp_path, "full")
    run.mark_stage("train", "running")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifacts.tempfile, "mkstemp", no_space)  # no new file can be made
    with pytest.raises(PipelineError, match="No space left on device"):
        run.mark_stage("train", "complete")
    run.mark_stage("train", "failed", "RuntimeError: " + "x" * 500)
    stage = run.manifest()["stages"]["train"]
    assert stage["status"] == "failed" and stage["error"].endswith("x" * 10)

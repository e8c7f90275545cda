import errno
import importlib.metadata
import json
import os

import pytest
import torch

from stages.run import artifacts, files
from stages.run.errors import PipelineError, UsageError


def test_register_records_sha256_and_verified_path_catches_a_flipped_bit(tmp_path):
    run = artifacts.create_run(tmp_path, "r1")
    path = run.root / "weights.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    entry = run.register("weights", path, kind="model", stage="test")
    assert entry["bytes"] == path.stat().st_size
    assert entry["sha256"] == files.sha256_file(path)
    assert run.verified_path("weights") == path

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match="weights: .* sha256"):
        run.verified_path("weights")


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
    with pytest.raises(UsageError, match="not allowed"):  # '$' had let a newline end a name,
        artifacts.create_run(tmp_path, "abc\n")  # and 'latest' then named no run
    with pytest.raises(UsageError, match="does not exist"):  # not ENAMETOOLONG's OSError
        artifacts.open_run(tmp_path, "a" * 300)
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


def test_a_failed_stage_is_written_over_the_manifest_when_no_new_file_fits(tmp_path, monkeypatch):
    run = artifacts.create_run(tmp_path, "full")
    run.mark_stage("train", "running")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.tempfile, "mkstemp", no_space)  # no new file can be made
    with pytest.raises(PipelineError, match="No space left on device"):
        run.mark_stage("train", "complete")
    run.mark_stage("train", "failed", "RuntimeError: " + "x" * 500)
    stage = run.manifest()["stages"]["train"]
    assert stage["status"] == "failed" and stage["error"].endswith("x" * 10)

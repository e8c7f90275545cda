import importlib.metadata
import json
import pickle

import pytest
import torch

from stages import artifacts
from stages.errors import PipelineError, UsageError


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
    with pytest.raises(PipelineError, match="weights-only"):
        artifacts.load_checkpoint(path)
    assert not marker.exists()


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

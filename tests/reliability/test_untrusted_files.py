"""Checkpoints and ONNX files from elsewhere: refused cleanly, never executed."""
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import cli
from stages.run import files, loading
from stages.run.errors import PipelineError
from stages.runtimes.onnxruntime import ort_session


class Payload:
    """Unpickling this runs ``open(marker, 'w')``: the side effect the tests look for."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(run, name, content: bytes):
    """Replace an artifact and its manifest entry, as a tampered download would."""
    relative = run.entry(name)["path"]
    path = run.root / relative
    path.write_bytes(content)
    manifest = json.loads(run.manifest_path.read_text())
    for entry in manifest["artifacts"].values():
        if entry["path"] == relative:
            entry |= {"sha256": files.sha256_file(path), "bytes": path.stat().st_size}
    run.manifest_path.write_text(json.dumps(manifest))


def _argv(run, *args):
    return ["--artifacts-dir", str(run.artifacts_dir), "--run", run.name, "--quiet", *args]


def _pipeline(run, *args):
    """The CLI in this process, with its exit code and output as a subprocess would have them."""
    result = CliRunner().invoke(cli, _argv(run, *args))
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout,
                           stderr=result.stderr)


def _pipeline_process(run, *args):
    """The same in a process of its own: what runs there is what a user's shell runs."""
    return subprocess.run([sys.executable, "-m", "pipeline", *_argv(run, *args)],
                          capture_output=True, text=True, timeout=300)


REPORT = ["report", "--rounds", "5", "--max-rounds", "5", "--repeats", "4", "--batch-sizes", "32"]


@pytest.mark.parametrize("stage_args, target, run_in", [
    (["quantize", "--methods", "torch-static"], "amp", _pipeline),
    (REPORT, "fp32", _pipeline_process),
    (REPORT, "torch-static", _pipeline),
    (["train", "--resume"], "amp/checkpoint-step0000042", _pipeline),  # the newest of 2 epochs
])
def test_a_code_carrying_checkpoint_is_refused_by_every_stage(fresh_tiny_run, tmp_path,
                                                              stage_args, target, run_in):
    run = fresh_tiny_run
    marker = tmp_path / "payload-ran"
    if target.startswith("amp/checkpoint"):  # make the resume start from the planted file
        manifest = json.loads(run.manifest_path.read_text())
        del manifest["artifacts"]["amp"]
        run.manifest_path.write_text(json.dumps(manifest))
    _plant(run, target, pickle.dumps({"state_dict": Payload(marker)}))
    proc = run_in(run, *stage_args)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("pipeline: error:") and lines[-1].endswith(
        "was refused: loading it would run code from the file; save the weights alone "
        "(torch.save(model.state_dict(), path)) and give that file")
    assert not marker.exists()


def test_a_flipped_bit_is_reported_by_name(fresh_tiny_run):
    run = fresh_tiny_run
    path = run.root / run.entry("torch-static")["path"]
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    proc = _pipeline(run, *REPORT)
    assert proc.returncode == 1
    assert "torch-static" in proc.stderr and "sha256" in proc.stderr


def test_a_graph_file_that_names_anything_but_an_operator_is_refused(fresh_tiny_run, tmp_path):
    """A PT2E file is data; one whose graph would call a Python function is refused before
    any of it runs, and says so in one line: through `pipeline report` for os.system, by the
    loader every stage uses for the rest. Each payload, had it run, would leave a file."""
    from stages.runtimes import pt2e

    run = fresh_tiny_run
    clean = run.verified_path("torch-static").read_bytes()
    for target in ["builtins.eval", "torch.load", "aten.conv2d", "aten.conv2d.default.extra",
                   "os.system"]:
        data = loading.load_checkpoint(io.BytesIO(clean))
        node = next(n for n in data["graph"]["nodes"] if n["op"] == "call_function")
        node["target"] = target
        marker = tmp_path / f"ran-{target}"
        node["args"] = [f"touch {marker}" if target == "os.system"
                        else f"__import__('pathlib').Path({str(marker)!r}).touch()"]
        buffer = io.BytesIO()
        torch.save(data, buffer)
        _plant(run, "torch-static", buffer.getvalue())
        if target != "os.system":
            with pytest.raises(PipelineError, match=f"calls {target!r}"):
                pt2e.load_pt2e(run, "torch-static")
            assert not marker.exists()
            continue
        proc = _pipeline(run, *REPORT)
        assert proc.returncode == 1, proc.stderr[-1000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert f"calls {target!r}" in line and "torch-static" in line
        assert not marker.exists()


@pytest.mark.parametrize("absolute", [False, True])
def test_a_manifest_entry_pointing_outside_the_run_is_refused_by_every_stage(
        fresh_tiny_run, tmp_path, absolute):
    """A path up out of the run folder, or an absolute one: both to a real copy of the file,
    in tmp_path beside the run's artifacts folder."""
    run = fresh_tiny_run
    outside = tmp_path / "elsewhere" / "outside.pt"
    assert run.root.resolve() not in outside.resolve().parents
    relative = str(outside) if absolute else str(Path(*[".."] * 3, "elsewhere", "outside.pt"))
    assert (run.root / relative).resolve() == outside.resolve()
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run.verified_path("amp"), outside)
    manifest = json.loads(run.manifest_path.read_text())
    manifest["artifacts"]["amp"] |= {"path": relative, "sha256": files.sha256_file(outside)}
    run.manifest_path.write_text(json.dumps(manifest))
    for args in (["quantize", "--methods", "ort-static"], REPORT):
        proc = _pipeline(run, *args)
        assert proc.returncode == 1, proc.stderr[-1000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line == (f"pipeline: error: manifest.json of run 'fresh': entry 'amp' points "
                        f"outside the run folder ('{relative}'); refusing to use it: restore "
                        "manifest.json or re-run the stage that wrote it")


def _onnx_with_external_data(folder: Path, source: Path, location: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(onnx.load(str(source)), str(path), save_as_external_data=True,
                    location="weights.data", size_threshold=0)
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for item in tensor.external_data:
            if item.key == "location":
                item.value = location
    onnx.save_model(proto, str(path))
    return path


@pytest.mark.parametrize("kind", ["parent", "absolute", "symlink"])
def test_external_data_pointing_outside_is_refused(tiny_run, tmp_path, kind):
    source = tiny_run["run"].verified_path("onnx-fp32")
    outside = tmp_path / "secret.data"
    outside.write_bytes(b"\0" * 64)
    location = {"parent": "../secret.data", "absolute": str(outside), "symlink": "link.data"}[kind]
    path = _onnx_with_external_data(tmp_path / "model", source, location)
    if kind == "symlink":
        (tmp_path / "model" / "link.data").symlink_to(outside)
    with pytest.raises(PipelineError, match="outside its folder"):
        ort_session(path, threads=1)


@pytest.mark.parametrize("content", ["garbage", "truncated"])
def test_garbage_or_truncated_onnx_is_a_clean_error_in_a_subprocess(tiny_run, tmp_path, content):
    source = tiny_run["run"].verified_path("onnx-fp32").read_bytes()
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07garbage" * 50 if content == "garbage"
                     else source[: len(source) // 2])
    code = ("import sys\nfrom stages.runtimes.onnxruntime import ort_session\n"
            "from stages.run.errors import PipelineError\n"
            "try:\n    ort_session(sys.argv[1], 1)\nexcept PipelineError as e:\n"
            "    print('CLEAN', e)\n    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-1000:])  # not a crash
    assert proc.stdout.startswith("CLEAN") and str(path) in proc.stdout


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_file_that_is_another_files_name_is_refused_and_left_alone(tmp_path, link):
    """A run folder copied in is data: its .lock linked to a user's file had that file
    truncated and overwritten by the lock's 'pid N' line."""
    from stages.run import artifacts, lock

    run = artifacts.create_run(tmp_path / "artifacts", "copied")
    victim = tmp_path / "notes.txt"
    victim.write_text("keep")
    if link == "symbolic":
        (run.root / ".lock").symlink_to(victim)
    else:
        os.link(victim, run.root / ".lock")
    with pytest.raises(PipelineError, match=r"\.lock (is a link|has another name)"):
        with lock.hold_run(run, "report"):
            pass
    assert victim.read_text() == "keep"

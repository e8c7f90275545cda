"""Wrong input gets a one-line error, never logits: the Python API's edge, predict's files, the
run folder's messages. Each test here failed before the check it holds was written."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

import pipeline
from pipeline.cli import cli
from pipeline.inputs import checked_batch, value_range
from stages import predict
from stages.data import preprocess
from stages.data.datasets import splits_of_run
from stages.run.errors import PipelineError

_MODELS: dict = {}
# The checks run in pipeline.Model.predict, which every variant's load returns, before any
# runtime is called: one variant of each way of serving (eager, Inductor-compiled, ONNX
# Runtime, OpenVINO) shows that none is reached around them, without compiling the others.
# That every variant answers good input: test_use_the_model.py.
SERVING_WAYS = ["amp", "fp32-compiled", "ort-static", "openvino-int8"]


def _model(run, name):
    """Each variant of the tiny run loaded once for this module (loading compiles some)."""
    if name not in _MODELS:
        _MODELS[name] = pipeline.load(run.root, name, threads=1)
    return _MODELS[name]


def _one_line_refusal(model, images, kind=ValueError) -> str:
    with pytest.raises(kind) as refused:
        model.predict(images)
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize("name", SERVING_WAYS)
def test_each_way_of_serving_refuses_what_its_model_cannot_take(tiny_run, name):
    model = _model(tiny_run["run"], name)  # 1 channel, 8x8
    good = splits_of_run(tiny_run["run"]).test.tensors[0][:2].numpy()
    assert model.predict(good).shape == (2, 10)  # the checks let real input through
    raw = np.full((2, 1, 8, 8), 200, np.uint8)
    assert "uint8 values (raw pixels?)" in _one_line_refusal(model, raw)
    assert "model.preprocess" in _one_line_refusal(model, raw)
    nan = np.full((2, 1, 8, 8), np.nan, np.float32)
    assert _one_line_refusal(model, nan).startswith("predict got 128 NaN or infinite value(s)")
    assert "shape (2, 1, 16, 16); this model takes (images, 1, 8, 8)" in _one_line_refusal(
        model, np.zeros((2, 1, 16, 16), np.float32))
    assert "shape (2, 3, 8, 8)" in _one_line_refusal(model, np.zeros((2, 3, 8, 8), np.float32))
    assert "from 200 to 200, outside" in _one_line_refusal(model, raw.astype(np.float32))
    assert "one str ('a.png')" in _one_line_refusal(model, "a.png", TypeError)
    assert "predict(['a.png'])" in _one_line_refusal(model, "a.png", TypeError)
    assert "an array of complex64" in _one_line_refusal(
        model, good.astype(np.complex64), TypeError)
    # As torch tensors, and inside a list, the same.
    assert "NaN" in _one_line_refusal(model, torch.from_numpy(nan))
    assert "uint8" in _one_line_refusal(model, [raw[0], raw[1]])


def test_a_list_item_neither_a_path_an_image_nor_an_array_is_refused_by_its_type(tiny_run,
                                                                                 tmp_path):
    """A list of numbers had reached os.stat (a refusal thousands of numbers long), and an
    integer was taken for an open file's descriptor ("it is a socket")."""
    model = _model(tiny_run["run"], "ort-static")
    good = splits_of_run(tiny_run["run"]).test.tensors[0][:1].numpy()
    for item, kind in ((good[0].tolist(), "list"), (3, "int"), (True, "bool")):
        assert _one_line_refusal(model, [item], TypeError) == (
            f"predict got a list holding a {kind}; it takes paths, PIL images or arrays "
            "(np.asarray(...) for array data)")
    for item, kind in ((3, "int"), (good[0], "ndarray")):  # model.preprocess alike
        with pytest.raises(TypeError) as refused:
            model.preprocess(item)
        assert str(refused.value) == (f"preprocess got a {kind}; it takes a path or a PIL image "
                                      "(an array is already preprocessed: give it to predict)")
    # A file name holding a newline is named on one line, escaped.
    (tmp_path / "x\ny.png").write_text("not an image")
    assert "x\\ny.png: " in _one_line_refusal(model, [tmp_path / "x\ny.png"])


def test_threads_must_be_a_count(tiny_run):
    for threads in (-3, 1.5, "2", True, 100_000):  # 100,000 went to every runtime's pool
        with pytest.raises(ValueError, match=r"threads=.*: give 0 \(as many as the machine has"):
            pipeline.load(tiny_run["run"].root, "ort-static", threads=threads)


def test_the_value_range_is_what_preprocessing_can_give(tiny_run, tmp_path):
    """Every image a file can hold (black, white, noise) passes; the range is not too tight."""
    model = _model(tiny_run["run"], "ort-static")
    low, high = value_range(model.spec)
    rng = np.random.default_rng(0)
    for pixels in (np.zeros((8, 8)), np.full((8, 8), 255), rng.integers(0, 256, (8, 8))):
        Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / "x.png")
        image = model.preprocess(tmp_path / "x.png")
        assert low.min() - 1e-6 <= image.min() and image.max() <= high.max() + 1e-6
        checked_batch(image, model.spec)


WRONG_DTYPES = st.sampled_from([np.uint8, np.int8, np.int16, np.int32, np.int64, np.bool_,
                                np.complex64, np.uint16])
WRONG_SHAPES = st.one_of(
    hnp.array_shapes(min_dims=0, max_dims=6, max_side=9).filter(
        lambda s: not (len(s) in (3, 4) and s[-3:] == (1, 8, 8))),
    st.tuples(st.integers(0, 3), st.sampled_from([2, 3, 4]), st.just(8), st.just(8)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_wrong_array_is_ever_answered_with_logits(tiny_run, data):
    """Arrays of a wrong dtype, a wrong shape, or non-finite or out-of-range values, against
    each way of serving: each is a one-line ValueError or TypeError, never logits."""
    name = data.draw(st.sampled_from(SERVING_WAYS), label="variant")
    model = _model(tiny_run["run"], name)
    kind = data.draw(st.sampled_from(["dtype", "shape", "values"]), label="what is wrong")
    batch = data.draw(st.integers(1, 3), label="batch")
    if kind == "dtype":
        array = data.draw(hnp.arrays(data.draw(WRONG_DTYPES), (batch, 1, 8, 8)))
    elif kind == "shape":
        array = data.draw(hnp.arrays(np.float32, data.draw(WRONG_SHAPES),
                                     elements=st.floats(-1, 1, width=32)))
    else:
        bad = st.one_of(st.sampled_from([np.nan, np.inf, -np.inf]), st.floats(50, 1e30),
                        st.floats(-1e30, -50))
        array = np.zeros((batch, 1, 8, 8), np.float32)
        flat = array.reshape(-1)
        for index in data.draw(st.lists(st.integers(0, flat.size - 1), min_size=1, max_size=4)):
            flat[index] = data.draw(bad)
    if data.draw(st.booleans(), label="as a torch tensor") and array.dtype != np.uint16:
        array = torch.from_numpy(np.ascontiguousarray(array))
    with pytest.raises((ValueError, TypeError)) as refused:
        model.predict(array)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("predict got")


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), prog_name="pipeline")


def _digit(path: Path, fmt: str | None = None) -> Path:
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(path, format=fmt)
    return path


def test_a_file_predict_cannot_read_is_named_in_one_line(tiny_run, tmp_path):
    """model.predict(paths) over many files, one of them truncated: Pillow's OSError came out
    as a traceback that named no file; now one line names it and says what to do."""
    good = _digit(tmp_path / "good.png", fmt="JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(good.read_bytes()[:200])
    why = _one_line_refusal(_model(tiny_run["run"], "amp"), [good, truncated])
    assert why.startswith(f"{truncated}: ") and why.endswith(
        "; remove it from the list, or pass the others")


def test_a_fifo_is_skipped_unopened(tiny_run, tmp_path):
    """A FIFO named as a path once hung predict (opened, it waits for a writer; and after the
    first SIGTERM the process ignored SIGTERM, which the next test holds). Now it is named and
    skipped, and the image beside it predicted."""
    run = tiny_run["run"]
    os.mkfifo(tmp_path / "f.png")
    ok = _digit(tmp_path / "ok.png")
    env = os.environ | {"PIPELINE_ARTIFACTS_DIR": str(run.artifacts_dir)}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--run", run.name, "predict",
                           "--variant", "ort-static", str(tmp_path / "f.png"), str(ok)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith(f"{ok}: ") and proc.stdout.count("\n") == 1
    assert (f"pipeline: skipped {tmp_path / 'f.png'}: it is a FIFO, not a regular file, so it "
            "was not opened") in proc.stderr
    assert "pipeline: error: 1 of 2 file(s) could not be predicted" in proc.stderr


def test_a_second_sigterm_ends_a_process_the_first_could_not(tmp_path):
    """The first SIGTERM raises SystemExit; a thread it cannot stop (here a sleep, in the field
    a blocked read) keeps the process alive, and the second SIGTERM must end it, not be
    ignored as it once was."""
    code = ("import threading, time\n"
            "from pipeline.cli import _fail_stage_on_sigterm\n"
            "_fail_stage_on_sigterm()\n"
            "threading.Thread(target=time.sleep, args=(120,)).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # held by its thread, as a stuck read would hold it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        proc.kill()


def test_ctrl_c_exits_130(tiny_run, monkeypatch):
    from stages import runtimes

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtimes, "load", interrupted)  # while predict loads the model
    result = _invoke("--artifacts-dir", str(tiny_run["run"].artifacts_dir), "predict",
                     str(Path(__file__)))
    assert result.exit_code == 130
    assert result.stderr.strip().endswith("pipeline: error: interrupted; files already written "
                                          "are complete, the rest were not written")


def test_every_file_of_a_folder_is_predicted_or_named(tiny_run, tmp_path):
    """A .gif and an image without an extension are images (Pillow reads content, not names);
    a text file is named as skipped; the count says so."""
    run, folder = tiny_run["run"], tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    _digit(folder / "a.png")
    _digit(folder / "anim.gif")
    _digit(folder / "sub" / "noextension", fmt="PNG")
    (folder / "notes.txt").write_text("not an image")
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # hidden: left out, as ls does
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main")
    result = _invoke("--artifacts-dir", str(run.artifacts_dir), "predict", str(folder),
                     "--variant", "ort-static")
    assert result.exit_code == 1
    predicted = sorted(line.split(": ")[0] for line in result.stdout.strip().splitlines())
    assert predicted == sorted(str(folder / n) for n in ("a.png", "anim.gif", "sub/noextension"))
    assert (f"pipeline: skipped {folder / 'notes.txt'}: not an image file Pillow can read"
            in result.stderr)
    assert result.stderr.strip().endswith("1 of 4 file(s) could not be predicted and were "
                                          "skipped (named above)")
    assert ".DS_Store" not in result.stderr and ".git" not in result.stderr


def test_linked_folders_are_followed_once_and_one_that_cannot_be_listed_is_named(
        tiny_run, tmp_path, monkeypatch):
    run, folder, elsewhere = tiny_run["run"], tmp_path / "photos", tmp_path / "elsewhere"
    (folder / "locked").mkdir(parents=True)
    elsewhere.mkdir()
    _digit(folder / "a.png")
    _digit(folder / "locked" / "c.png")
    _digit(elsewhere / "b.png")
    _digit(folder / "fenced.png")
    (folder / "linked").symlink_to(elsewhere)
    (folder / "loop").symlink_to(folder)  # followed, it would never end
    real_iterdir, real_scandir, real_is_dir = Path.iterdir, os.scandir, Path.is_dir

    def denied(*path):  # root lists any folder, so the refusal is simulated
        if path and isinstance(path[0], (str, Path)) and Path(path[0]) == folder / "locked":
            raise PermissionError(13, "Permission denied", str(path[0]))

    monkeypatch.setattr(Path, "iterdir", lambda self: denied(self) or real_iterdir(self))
    monkeypatch.setattr(os, "scandir", lambda *path: denied(*path) or real_scandir(*path))
    # A folder listed but not entered: stat of what it lists fails, and Path.is_dir raises
    # (Python 3.11 and 3.12) where it had ended predict in a PermissionError.
    monkeypatch.setattr(Path, "is_dir", lambda self: (
        self == folder / "fenced.png" and denied(folder / "locked")) or real_is_dir(self))
    result = _invoke("--artifacts-dir", str(run.artifacts_dir), "predict", str(folder),
                     "--variant", "ort-static")
    assert result.exit_code == 1, result.output
    predicted = sorted(line.split(": ")[0] for line in result.stdout.strip().splitlines())
    assert predicted == [str(folder / "a.png"), str(folder / "fenced.png"),
                         str(folder / "linked" / "b.png")], result.stderr
    assert (f"pipeline: skipped {folder / 'locked'}: permission denied: this user cannot read "
            "it") in result.stderr
    assert result.stderr.strip().endswith("1 of 4 file(s) could not be predicted and were "
                                          "skipped (named above)")


def test_an_exported_predict_py_names_a_path_it_cannot_open_in_one_line(tmp_path, capsys):
    """Path.exists raised on a name too long (or a folder this user cannot enter): a
    traceback from the exported script where pipeline predict said one line."""
    import argparse

    long_name, missing = str(tmp_path / ("a" * 300)), str(tmp_path / "missing.png")
    args = argparse.Namespace(paths=[long_name, missing], top_k=1, batch_size=4)
    assert predict.main(args, {}, lambda batch: None) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("predict.py: ")
    assert "a" * 300 + ": File name too long" in err
    assert f"{missing}: no such file or folder" in err


def test_unreadable_files_say_why(tmp_path, monkeypatch, recwarn):
    spec = {"colour": "L", "image_size": 8}
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for side in (40, 100):  # over the limit: Pillow warns; over twice it: Pillow raises
        Image.fromarray(np.zeros((side, side), np.uint8)).save(tmp_path / f"big{side}.png")
        with pytest.raises(preprocess.Unreadable, match="more pixels than Pillow's limit of "
                                                        "1,000"):
            preprocess.decode(tmp_path / f"big{side}.png", spec)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
    locked = _digit(tmp_path / "locked.png")
    real_open = os.open

    def denied(path, *args, **kwargs):  # root reads any file, so the refusal is simulated
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(preprocess.Unreadable, match="permission denied: this user cannot read"):
        preprocess.decode(locked, spec)


def test_a_name_holding_a_newline_cannot_forge_a_result_line(tmp_path, capsys):
    spec = {"colour": "L", "image_size": 8, "channels": 1, "mean": [0.5], "std": [0.5],
            "classes": ["cat\n/forged.png: dog (1.000)", "dog"]}
    image = _digit(tmp_path / "x\ny.png")
    skipped = predict.print_predictions([image], spec, lambda batch: np.array([[5.0, 0.0]]),
                                        4, 1, "pipeline")
    out = capsys.readouterr().out
    assert skipped == 0 and out.count("\n") == 1
    assert out == f"{tmp_path}/x\\ny.png: cat\\n/forged.png: dog (1.000) (0.993)\n"


def test_a_copied_run_without_latest_lists_the_runs_and_a_folder_path_is_a_run(tiny_run,
                                                                               tmp_path):
    import shutil

    artifacts = tmp_path / "copied"
    shutil.copytree(tiny_run["run"].root, artifacts / "runs" / "mine")
    image = str(_digit(tmp_path / "a.png"))
    no_latest = _invoke("--artifacts-dir", str(artifacts), "predict", image)
    assert no_latest.exit_code == 2
    assert (f"pipeline: error: {artifacts} has no 'latest' pointer, so no run is the latest; "
            "pass --run NAME (existing runs: mine)") in no_latest.stderr
    by_path = _invoke("--run", str(artifacts / "runs" / "mine"), "predict", image,
                      "--variant", "ort-static")
    assert by_path.exit_code == 0, by_path.stderr
    elsewhere = tmp_path / "deploy" / "run"
    shutil.copytree(tiny_run["run"].root, elsewhere)
    assert _invoke("predict", image, "--run", str(elsewhere), "--variant",
                   "ort-static").exit_code == 0
    not_a_run = _invoke("--run", str(tmp_path), "predict", image)
    assert not_a_run.exit_code == 2
    assert f"{tmp_path} is not a run folder (it has no manifest.json)" in not_a_run.stderr


@pytest.mark.parametrize("content, problem", [
    ({}, "it has no 'artifacts' object"),
    ([], "it holds a JSON list, not an object"),
    ({"artifacts": {"fp32": {"path": "train/fp32/model.pt", "bytes": 1}}},
     "entry 'fp32' lacks its path, sha256 or bytes"),
    ({"artifacts": {}, "stages": []}, "its 'stages' are not objects"),
])
def test_a_manifest_of_the_wrong_shape_is_one_line(cheap_run, tmp_path, content, problem):
    cheap_run.manifest_path.write_text(json.dumps(content))
    result = _invoke("--artifacts-dir", str(cheap_run.artifacts_dir), "predict",
                     str(_digit(tmp_path / "a.png")))
    assert result.exit_code == 1
    assert result.stderr == (f"pipeline: error: {cheap_run.manifest_path} is not a run's "
                             f"manifest ({problem}); restore it or start a new run with "
                             "'pipeline train'\n")


def test_export_onto_a_link_to_an_empty_folder_writes_there(cheap_run, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    result = _invoke("--artifacts-dir", str(cheap_run.artifacts_dir), "export",
                     str(tmp_path / "link"), "--variant", "ort-static")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "target" / "model.onnx").is_file()
    assert predict.verify_folder(tmp_path / "target") is None
    # The exported predict.py checks its files first: a changed one stops it, exit 1.
    spec = tmp_path / "target" / "preprocessing.json"
    spec.write_text(spec.read_text().replace('"image_size": 8', '"image_size": 9'))
    proc = subprocess.run([sys.executable, str(tmp_path / "link" / "predict.py"),
                           str(_digit(tmp_path / "a.png"))], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == ("predict.py: preprocessing.json does not match its sha256 in "
                           "manifest.json (changed or truncated since export); export the "
                           "variant again\n")


def test_export_fills_the_empty_folder_it_is_run_in(cheap_run, tmp_path, monkeypatch):
    """`pipeline export .` in an empty folder (or a container's empty mount point) had failed
    after the whole export: it removed OUT_DIR to rename its new folder there."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    result = _invoke("--artifacts-dir", str(cheap_run.artifacts_dir), "export", ".",
                     "--variant", "ort-static")
    assert result.exit_code == 0, result.stderr
    assert predict.verify_folder(tmp_path / "here") is None  # every file, as its manifest lists
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == [
        "manifest.json", "model.onnx", "predict.py", "predict_loop.py", "preprocess.py",
        "preprocessing.json"]  # and no scratch left


def test_a_rerun_that_succeeds_drops_the_old_error(cheap_run):
    cheap_run.mark_stage("quantize", "failed", "RuntimeError: boom")
    assert cheap_run.manifest()["stages"]["quantize"]["error"] == "RuntimeError: boom"
    cheap_run.mark_stage("quantize", "running")
    cheap_run.mark_stage("quantize", "complete", seconds=1.0)
    assert "error" not in cheap_run.manifest()["stages"]["quantize"]
    assert cheap_run.manifest()["stages"]["quantize"]["status"] == "complete"


def test_report_checks_every_variants_file_before_it_loads_any(cheap_run, monkeypatch, tmp_path):
    """In this process (the report measures in a child a patch cannot reach): a changed file
    of the last variant served stops the measuring before any variant is loaded."""
    from pipeline.config import ReportConfig
    from stages.report import measuring

    loaded = []
    real_servings = measuring.servings

    def recording_servings(*args):
        def recorded(name, load):
            return lambda: loaded.append(name) or load()
        return [(name, variant, recorded(name, load))
                for name, variant, load in real_servings(*args)]

    monkeypatch.setattr(measuring, "servings", recording_servings)
    path = cheap_run.root / cheap_run.entry("ort-static")["path"]
    path.write_bytes(path.read_bytes() + b"\0")  # the last variant the report would load
    with pytest.raises(PipelineError, match="ort-static: .* does not match its sha256"):
        measuring.measure_variants(cheap_run, ReportConfig(batch_sizes=(1,), quiet=True), 1,
                                   tmp_path)
    assert loaded == []


"""What was compressed, used in one line: pipeline.load, pipeline predict, pipeline export."""
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import pipeline
from pipeline.cli import cli
from stages.data import preprocess
from stages.data.datasets import splits_of_run
from stages.measure.machine import cpu_has_vnni
from stages.run.errors import UsageError
from stages.runtimes import inductor
from tests.conftest import FROM_QUANTIZE


def _digit_files(folder: Path, count: int = 12) -> tuple[list[Path], list[int]]:
    """Test-split digits as the 8-bit PNG files a user would have (the data set's 0..16 scaled
    to 0..255), and their labels."""
    from stages.data.datasets import digits_arrays, stratified_split

    images, targets = digits_arrays()
    _, test = stratified_split(targets, 0.2, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    paths, labels = [], []
    for index in sorted(test)[:count]:
        path = folder / f"digit-{index}.png"
        Image.fromarray(np.round(images[index] * (255 / 16)).astype(np.uint8)).save(path)
        paths.append(path)
        labels.append(int(targets[index]))
    return paths, labels


@pytest.mark.parametrize("name", FROM_QUANTIZE)
def test_every_variant_loads_in_one_line_and_predicts_what_the_report_scored(tiny_run, name):
    run, report = tiny_run["run"], tiny_run["report"]
    model = pipeline.load(run.root, variant=name)
    assert model.variant == name and model.classes == [str(i) for i in range(10)]
    test = splits_of_run(run).test
    images, labels = test.tensors
    logits = model.predict(images.numpy())
    assert isinstance(logits, np.ndarray) and logits.shape == (360, 10)
    row = next(m for m in report["models"] if m["name"] == name)
    # The report scored it in a process of its own: the same number of images right. A bf16
    # variant may round one near tie the other way: on an AMX CPU this process is capped
    # below AMX (conftest) and the report's was not.
    right = (logits.argmax(1) == labels.numpy()).sum()
    allowed = 1 if row["precision"] == "bf16" else 0
    assert abs(right - round(row["test"]["accuracy"] * 360)) <= allowed


def test_recommended_is_the_reports_choice_and_needs_a_report(tiny_run, fresh_tiny_run):
    run = tiny_run["run"]
    assert pipeline.load(run.root).variant == tiny_run["report"]["verdict"]["recommended"]
    with pytest.raises(UsageError, match="has no report yet, so nothing is recommended; run "
                                         "'pipeline report' first, or name a variant"):
        pipeline.load(fresh_tiny_run.root)
    with pytest.raises(UsageError, match=r"has no variant 'ort-static'; it has: fp32, amp, "
                                         r"torch-static \(or recommended\)"):
        pipeline.load("fresh", "ort-static", artifacts_dir=fresh_tiny_run.artifacts_dir)


def test_recommended_is_refused_once_its_variant_is_made_again_after_the_report(tiny_run,
                                                                               tmp_path):
    """quantize run again after the report lists another file under the recommended name: the
    report's figures are not that file's, so load, predict and export refuse it."""
    from stages import runtimes
    from tests.conftest import _copy

    run = _copy(tiny_run["run"], tmp_path / "artifacts")
    name = tiny_run["report"]["verdict"]["recommended"]
    assert runtimes.resolve(run, "recommended") == name
    manifest = run.manifest()
    manifest["artifacts"][name]["sha256"] = "0" * 64  # as a file made again would list
    run._write_manifest(manifest)
    with pytest.raises(UsageError, match=f"its report recommends {name}, which was made again "
                                         "since the report measured it; run 'pipeline report' "
                                         "again, or name a variant"):
        runtimes.resolve(run, "recommended")


def test_recommended_openvino_is_refused_once_its_weights_file_changes(tiny_run, tmp_path):
    """OpenVINO's .bin holds the weights; a variant made again with other weights may keep a
    byte-identical .xml, so the .bin's digest is compared too."""
    from stages import runtimes
    from tests.conftest import _copy

    run = _copy(tiny_run["run"], tmp_path / "artifacts")
    report_path = run.verified_path("report/report.json")
    report = json.loads(report_path.read_text())
    report["verdict"]["recommended"] = "openvino-int8"
    report_path.write_text(json.dumps(report))
    listed = run.entry("report/report.json")
    run.register("report/report.json", report_path, kind=listed["kind"], stage=listed["stage"])
    assert runtimes.resolve(run, "recommended") == "openvino-int8"
    manifest = run.manifest()
    manifest["artifacts"]["openvino-int8"]["files"][0]["sha256"] = "0" * 64
    run._write_manifest(manifest)
    with pytest.raises(UsageError, match="its report recommends openvino-int8, which was made "
                                         "again since the report measured it"):
        runtimes.resolve(run, "recommended")



def test_an_exported_folder_warns_where_the_cpu_lacks_the_vnni_it_was_quantized_for():
    from stages.predict import vnni_warning

    made_for_vnni = {"made_for_vnni": True}
    assert vnni_warning(made_for_vnni, {"avx2", "fma"}).startswith(
        "this model was quantized on a CPU with VNNI (full 8-bit weights) and this one has none")
    assert vnni_warning(made_for_vnni, {"avx2", "avx512_vnni"}) is None
    assert vnni_warning(made_for_vnni, set()) is None  # no /proc/cpuinfo: unknown, not said
    assert vnni_warning({"made_for_vnni": False}, {"avx2"}) is None
    assert vnni_warning({}, {"avx2"}) is None  # exported before the field


def test_a_run_folder_copied_anywhere_loads(tiny_run, tmp_path):
    import shutil

    run = tiny_run["run"]
    copy = tmp_path / "deployed" / "my-run"
    shutil.copytree(run.root, copy)
    model = pipeline.load(copy, "ort-static")
    assert model.run_name == "my-run"
    images = splits_of_run(run).test.tensors[0][:16].numpy()
    np.testing.assert_array_equal(model.predict(images),
                                  pipeline.load(run.root, "ort-static").predict(images))


def test_a_digit_file_is_preprocessed_as_the_data_set_was(tiny_run, tmp_path):
    """A PNG of a test digit becomes, within its 8-bit rounding, the tensor the report scored
    (8x8 normalised, then resized bilinearly to the model's 8x8 here)."""
    run = tiny_run["run"]
    model = pipeline.load(run.root, variant="fp32")
    paths, labels = _digit_files(tmp_path / "digits", count=5)
    images = splits_of_run(run).test.tensors[0][:5].numpy()
    for path, image in zip(paths, images):
        np.testing.assert_allclose(model.preprocess(path), image, atol=0.02)
    assert model.predict(paths).argmax(1).tolist() == model.predict(images).argmax(1).tolist()
    # The same digit as 16-bit grey (PNG's I;16) is the same input, not clipped at 255 of 65535.
    pixels = np.asarray(Image.open(paths[0]), dtype=np.uint16) * 257
    Image.fromarray(pixels).save(tmp_path / "sixteen.png")
    assert Image.open(tmp_path / "sixteen.png").mode == "I;16"
    np.testing.assert_array_equal(model.preprocess(tmp_path / "sixteen.png"),
                                  model.preprocess(paths[0]))
    np.testing.assert_array_equal(model.preprocess(Image.fromarray(pixels.astype(np.int32))),
                                  model.preprocess(paths[0]))  # mode I, as older Pillows open it
    with pytest.raises(ValueError, match="32-bit floats, whose range is unknown"):
        model.preprocess(Image.fromarray(pixels.astype(np.float32)))


def test_the_resize_is_torchs_bilinear_interpolation():
    rng = np.random.default_rng(0)
    for source, size in ((8, 32), (8, 8), (5, 17), (28, 14)):
        array = rng.normal(size=(2, source, source)).astype(np.float32)
        expected = torch.nn.functional.interpolate(
            torch.from_numpy(array)[None], size=(size, size), mode="bilinear",
            align_corners=False)[0].numpy()
        np.testing.assert_allclose(preprocess._resize_half_pixel(array, size), expected,
                                   atol=1e-5)


def test_importing_pipeline_does_not_import_torch():
    code = "import sys, pipeline\nprint('torch' in sys.modules, callable(pipeline.load))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), prog_name="pipeline")


def test_predict_prints_a_line_per_image_and_names_what_it_skipped(tiny_run, tmp_path):
    run = tiny_run["run"]
    paths, labels = _digit_files(tmp_path / "digits")
    (tmp_path / "digits" / "notes.png").write_text("not an image")
    # Options before the paths and after them, as the README writes it.
    result = _invoke("--artifacts-dir", str(run.artifacts_dir), "--run", run.name, "predict",
                     "--variant", "ort-static", str(tmp_path / "digits"), "--top-k", "2")
    assert result.exit_code == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(paths)
    expected = pipeline.load(run.root, "ort-static").predict(paths).argmax(1)
    for line, path, best in zip(lines, sorted(paths), expected[np.argsort(
            [str(p) for p in paths])]):
        assert line.startswith(f"{path}: {best} (") and line.count("(") == 2
    errors = result.stderr.strip().splitlines()
    assert errors[0].startswith(f"pipeline: skipped {tmp_path / 'digits' / 'notes.png'}: ")
    assert errors[-1] == ("pipeline: error: 1 of 13 file(s) could not be predicted and were "
                          "skipped (named above)")
    as_json = _invoke("--artifacts-dir", str(run.artifacts_dir), "predict", str(paths[0]),
                      "--json", "--run", run.name)
    assert as_json.exit_code == 0, as_json.stderr
    record = json.loads(as_json.stdout)
    assert record["path"] == str(paths[0]) and len(record["top"]) == 1
    assert record["variant"] == tiny_run["report"]["verdict"]["recommended"]
    (tmp_path / "empty").mkdir()
    empty = _invoke("--artifacts-dir", str(run.artifacts_dir), "predict", str(tmp_path / "empty"))
    assert empty.exit_code == 2
    assert f"{tmp_path / 'empty'}: no files in this folder" in empty.stderr
    # Reading changes nothing in the run: no stage status, no lock taken.
    assert "predict" not in run.manifest()["stages"]


def _only_onnxruntime_numpy_pillow(folder: Path,
                                   names=("onnxruntime", "numpy", "numpy.libs", "PIL",
                                          "pillow.libs")) -> Path:
    """A virtual environment holding onnxruntime, numpy and Pillow (or ``names``) and nothing
    else (linked from this one's, so the test needs no network): no torch, no pipeline."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                  "get_paths()['purelib'])"], capture_output=True, text=True,
                                 check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in names:
        if (ours / name).exists():
            (target / name).symlink_to(ours / name)
    return python


def test_an_exported_predict_py_batches_as_pipeline_predict_does():
    """A bf16 model's near ties may round another way in a batch of another size: the
    exported script had batched 16 images where `pipeline predict` batches 64."""
    import dataclasses

    from pipeline.config import PredictConfig
    from stages import predict

    defaults = {f.name: f.default for f in dataclasses.fields(PredictConfig)}
    assert defaults["batch_size"] == predict.BATCH_SIZE


def test_predict_into_a_pipe_its_reader_closes_stops_without_a_word(tiny_run, tmp_path):
    """`pipeline predict photos/ | head -3` had ended in "error: BrokenPipeError", exit 1."""
    paths, _ = _digit_files(tmp_path / "digits", count=200)
    run = tiny_run["run"]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "--artifacts-dir",
                             str(run.artifacts_dir), "--run", run.name, "predict", "--variant",
                             "ort-static", "--batch-size", "1", str(tmp_path / "digits")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # as head does once it has its lines
    error = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and error == "", error
    assert first.startswith(str(tmp_path / "digits"))


def test_an_exported_folder_runs_with_onnxruntime_numpy_and_pillow_alone(tiny_run, tmp_path):
    run = tiny_run["run"]
    out = tmp_path / "exported"
    result = _invoke("--artifacts-dir", str(run.artifacts_dir), "--run", run.name, "export",
                     str(out), "--variant", "ort-static")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == f"export: {out}"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx",
                                                     "predict.py", "predict_loop.py",
                                                     "preprocess.py", "preprocessing.json"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["variant"] == "ort-static" and manifest["serving"]["runtime"] == "onnxruntime"
    from stages.run.files import sha256_file

    assert {name: record["sha256"] for name, record in manifest["files"].items()} == {
        p.name: sha256_file(p) for p in out.iterdir() if p.name != "manifest.json"}
    spec = json.loads((out / "preprocessing.json").read_text())
    assert spec["classes"] == [str(i) for i in range(10)] and spec["image_size"] == 8

    python = _only_onnxruntime_numpy_pillow(tmp_path / "env")
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode
    paths, _ = _digit_files(tmp_path / "digits")
    proc = subprocess.run([str(python), str(out / "predict.py"), *map(str, paths), "--top-k",
                           "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ours = _invoke("--artifacts-dir", str(run.artifacts_dir), "--run", run.name, "predict",
                   "--variant", "ort-static", *map(str, paths), "--top-k", "2")
    def classes(output: str) -> list[str]:  # "PATH: 3 (0.912), 5 (0.071)" -> "PATH: 3, 5"
        return [re.sub(r" \([0-9.]+\)", "", line) for line in output.strip().splitlines()]

    assert classes(proc.stdout) == classes(ours.stdout) and ", " in classes(ours.stdout)[0]
    usage = subprocess.run([str(python), str(out / "predict.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "IMAGE_OR_FOLDER [IMAGE_OR_FOLDER ...]" in usage.stdout
    missing = subprocess.run([str(python), str(out / "predict.py"), str(tmp_path / "nope.png")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr == f"predict.py: {tmp_path / 'nope.png'}: no such file or folder\n"
    # Without its runtime: one line naming what to install, not an import's traceback.
    bare = _only_onnxruntime_numpy_pillow(tmp_path / "bare", ("numpy", "numpy.libs", "PIL",
                                                               "pillow.libs"))
    no_runtime = subprocess.run([str(bare), str(out / "predict.py"), str(paths[0])],
                                capture_output=True, text=True, timeout=120)
    assert no_runtime.returncode == 1
    assert no_runtime.stderr == (
        "predict.py: this model needs onnxruntime, which cannot be imported here (No module "
        "named 'onnxruntime'): pip install onnxruntime numpy pillow\n")
    # Nor without Pillow, which onnxruntime does not pull in (it had been a traceback).
    no_pillow = _only_onnxruntime_numpy_pillow(tmp_path / "nopil", ("onnxruntime", "numpy",
                                                                     "numpy.libs"))
    without = subprocess.run([str(no_pillow), str(out / "predict.py"), str(paths[0])],
                             capture_output=True, text=True, timeout=120)
    assert (without.returncode, without.stderr) == (1, (
        "predict.py: this model needs PIL, which cannot be imported here (No module named "
        "'PIL'): pip install onnxruntime numpy pillow\n"))
    # Under python -I, which leaves the script's folder off sys.path, it finds its neighbours;
    # one gone is named, not mistaken for a package to install.
    isolated = subprocess.run([str(python), "-I", str(out / "predict.py"), str(paths[0])],
                              capture_output=True, text=True, timeout=120)
    assert isolated.returncode == 0 and isolated.stdout.startswith(str(paths[0])), isolated
    # An export never writes over a folder that holds anything.
    again = _invoke("--artifacts-dir", str(run.artifacts_dir), "--run", run.name, "export",
                    str(out))
    assert again.exit_code == 2 and "already exists and is not an empty folder" in again.stderr
    # Nor makes one under a file: one line naming it, exit 2.
    (tmp_path / "afile").write_text("mine")
    under_a_file = _invoke("--artifacts-dir", str(run.artifacts_dir), "--run", run.name,
                           "export", str(tmp_path / "afile" / "sub" / "out"))
    assert under_a_file.exit_code == 2
    assert (f"cannot create {tmp_path / 'afile' / 'sub' / 'out'}: {tmp_path / 'afile'} is a file, "
            "not a folder; give another OUT_DIR") in under_a_file.stderr
    # A model its runtime cannot load (an IR version from a newer exporter): one line naming
    # both versions, not onnxruntime's traceback.
    model = onnx.load(out / "model.onnx")
    model.ir_version = 99
    onnx.save(model, out / "model.onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = {"sha256": sha256_file(out / "model.onnx"),
                                       "bytes": (out / "model.onnx").stat().st_size}
    (out / "manifest.json").write_text(json.dumps(manifest))
    newer = subprocess.run([str(python), str(out / "predict.py"), str(paths[0])],
                           capture_output=True, text=True, timeout=120)
    made = manifest["versions"]["onnxruntime"]
    assert newer.returncode == 1 and newer.stderr.count("\n") == 1, newer.stderr
    assert newer.stderr.startswith(f"predict.py: onnxruntime {made} cannot load model.onnx (")
    assert newer.stderr.endswith(f"it was made with onnxruntime {made}: pip install "
                                 f"'onnxruntime=={made}'\n")
    (out / "predict_loop.py").unlink()
    gone = subprocess.run([str(python), str(out / "predict.py"), str(paths[0])],
                          capture_output=True, text=True, timeout=120)
    assert (gone.returncode, gone.stderr) == (1, f"predict.py: predict_loop.py is missing from "
                                                 f"{out.resolve()}; export the variant again\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["openvino-int8", "torch-static", "amp"])
def test_other_runtimes_export_and_predict_the_same_top_1(tiny_run, tmp_path, name):
    run = tiny_run["run"]
    out = tmp_path / name
    result = _invoke("--artifacts-dir", str(run.artifacts_dir), "--run", run.name, "export",
                     "--variant", name, str(out))
    assert result.exit_code == 0, result.stderr
    if name.startswith("torch") or name == "amp":
        assert "model.pt2 is torch.export's format, whose loader can run code" in result.stderr
        # and the folder's own script says it to whoever runs it later
        helped = subprocess.run([sys.executable, str(out / "predict.py"), "--help"],
                                capture_output=True, text=True, timeout=60)
        assert "loading it can run code" in " ".join(helped.stdout.split()), helped.stdout
    if name == "torch-static":  # compiled: without a C++ compiler, one line, not a traceback
        bare = subprocess.run([sys.executable, str(out / "predict.py"), str(out)],
                              capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "CXX"}
                              | {"PATH": str(tmp_path / "no-compilers")})
        assert (bare.returncode, bare.stderr) == (1, (
            "predict.py: this model runs compiled by torch.compile, which needs a C++ compiler, "
            "and g++ is not on PATH: install g++, or name one in CXX\n"))
    paths, _ = _digit_files(tmp_path / "digits")
    # The code Inductor generates, on stderr: an int8 graph must compile to int8 kernels there
    # as in the report (without torchao's passes it compiled to float convolutions).
    logs = {"TORCH_LOGS": "output_code"} if name == "torch-static" else {}
    proc = subprocess.run([sys.executable, str(out / "predict.py"), *map(str, paths)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=os.environ | logs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    # The runtime (and torch's torchao) that made it, by version: a model.pt2 loads only in a
    # torch that reads its format.
    assert set(manifest["requires"]) - {"numpy", "pillow"} <= set(manifest["versions"])
    # What predict.py warns about on a CPU without VNNI: torch-static's full 8-bit weights.
    assert manifest["serving"]["made_for_vnni"] is (name == "torch-static" and cpu_has_vnni())
    if logs:
        assert "torchao" in manifest["requires"]
        kernels = {key: len(re.findall(pattern, proc.stderr))
                   for key, pattern in inductor.KERNELS.items()}
        assert kernels[("Conv", "int8")] > 0 and kernels[("Conv", "float")] == 0, kernels
    ours = [str(i) for i in pipeline.load(run.root, name).predict(paths).argmax(1)]
    theirs = [line.rsplit(": ", 1)[1].split(" ")[0] for line in proc.stdout.strip().splitlines()]
    # amp runs under bf16 autocast, where a batch of 16 and one of 12 round differently: the
    # tiny model's near ties may flip, one image in twelve at most.
    allowed = 1 if name == "amp" else 0
    assert len(theirs) == len(ours) and sum(a != b for a, b in zip(theirs, ours)) <= allowed


def test_an_export_sets_the_onednn_cap_its_variant_ran_faster_under(cheap_run, tmp_path,
                                                                    monkeypatch):
    """Where the report found a variant faster with oneDNN capped below AMX, its exported
    folder's manifest carries the cap and predict.py sets it before the runtime loads (a
    user's own setting stays)."""
    from pipeline.config import ExportConfig
    from stages import export
    from stages import predict as predict_loop
    from stages.run.files import atomic_write_json

    path = cheap_run.verified_path("report/report.json")
    report = json.loads(path.read_text())
    row = next(r for r in report["models"] if r["name"] == "ort-static")
    row["below_amx"] = {"onednn_max_cpu_isa": "AVX512_CORE_BF16", "latency_ms": {},
                        "amx_speedup": {"32": {"ratio": 0.8, "low": 0.75, "high": 0.9}}}
    atomic_write_json(path, report)
    cheap_run.register("report/report.json", path, kind="report", stage="report")
    out = export.run(ExportConfig(out_dir=str(tmp_path / "capped"), variant="ort-static",
                                  quiet=True), cheap_run)
    serving = json.loads((out / "manifest.json").read_text())["serving"]
    assert serving["environment"] == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    monkeypatch.setattr(sys, "argv", ["predict.py", "a.png"])
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    predict_loop.arguments("doc", out)
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the user's
    predict_loop.arguments("doc", out)
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    plain = export.run(ExportConfig(out_dir=str(tmp_path / "plain"), variant="onnx-fp32",
                                    quiet=True), cheap_run)
    assert "environment" not in json.loads((plain / "manifest.json").read_text())["serving"]


def test_int8_made_for_vnni_warns_where_it_is_loaded_without_vnni(tiny_run, tmp_path,
                                                                  monkeypatch):
    """A run folder made on a CPU with VNNI (full 8-bit weights) and loaded on one without,
    where AVX2's int8 products can saturate: a warning, and none where the CPU has VNNI or the
    weights were made for one without (7-bit, reduce_range)."""
    from stages import runtimes
    from stages.measure import machine
    from tests.conftest import _copy

    run = _copy(tiny_run["run"], tmp_path / "artifacts")
    manifest = run.manifest()
    manifest["artifacts"]["ort-static"]["quantization"]["reduce_range"] = False
    manifest["artifacts"]["torch-static"]["quantization"]["options"]["weight_bits"] = 7
    run._write_manifest(manifest)  # as made on a CPU with VNNI, and torch-static without
    monkeypatch.setattr(machine, "cpu_has_vnni", lambda: False)
    with pytest.warns(UserWarning, match="ort-static was made on a CPU with VNNI .* make it "
                                         "again on this CPU"):
        pipeline.load(run.root, "ort-static")
    assert runtimes.vnni_mismatch(run, "torch-static") is None
    assert runtimes.vnni_mismatch(run, "amp") is None
    monkeypatch.setattr(machine, "cpu_has_vnni", lambda: True)
    assert runtimes.vnni_mismatch(run, "ort-static") is None

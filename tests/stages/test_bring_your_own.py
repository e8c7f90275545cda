"""Your model, not only ours: a model from a module path, a timm model, a model imported from a
checkpoint, starting weights from a file; each runs quantize and report on the digits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.config import ImportConfig, QuantizeConfig, TrainConfig
from stages import import_model, quantize, train
from stages.models import weights
from stages.run import artifacts, files, loading
from stages.run.errors import PipelineError

USER_MODULE = """
import torch.nn as nn


def tiny(num_classes, in_channels):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, num_classes))
"""
QUICK = ["quantize", "--methods", "ort-static", "--calibration-samples", "64",
         "report", "--rounds", "5", "--max-rounds", "5", "--repeats", "4", "--warmup", "1",
         "--batch-sizes", "32"]


def _pipeline(tmp_path, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pipeline", "--artifacts-dir",
                           str(tmp_path / "artifacts"), "--quiet", *args], capture_output=True,
                          text=True, timeout=900, cwd=cwd,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])})


def _report(tmp_path, run):
    return json.loads((tmp_path / "artifacts" / "runs" / run / "report" / "report.json")
                      .read_text())


@pytest.mark.slow
@pytest.mark.longest
def test_a_users_model_trains_quantizes_and_is_rebuilt_from_the_manifest(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "usernets.py").write_text(USER_MODULE)
    proc = _pipeline(tmp_path, "--run", "mine", "train", "--model", "usernets:tiny",
                     "--image-size", "8", "--epochs", "2", "--lr", "0.05", "--precision", "fp32",
                     "--no-measure-memory", *QUICK[:2], "torch-static", *QUICK[3:],
                     cwd=project)
    assert proc.returncode == 0, proc.stderr[-2000:]
    models = {m["name"]: m for m in _report(tmp_path, "mine")["models"]}
    assert models["torch-static"]["op_counts"]["Conv"]["int8"] == 1
    run = artifacts.open_run(tmp_path / "artifacts", "mine")
    # The report's process rebuilt the model and scored it as training did (0.40 after two
    # epochs of this 8-channel net, four times chance).
    assert models["fp32"]["accuracy"] == run.entry("fp32")["training"]["test_accuracy"] >= 0.3
    spec = run.entry("amp")["model_spec"]
    assert spec["model"] == "usernets:tiny"
    # A later stage in another process rebuilds the model from what the manifest records,
    # and says so when that code has gone.
    (project / "usernets.py").unlink()
    gone = _pipeline(tmp_path, "--run", "mine", "report", cwd=project)
    assert gone.returncode == 1
    assert "--model usernets:tiny: cannot import it" in gone.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_timm_model_trains_and_quantizes_whole(tmp_path):
    # What is tested is that timm's graph quantizes whole, not how much one epoch keeps: the
    # held-out images of a model this close to chance flip often, so no budget would hold at
    # 95% confidence and its most sensitive convolutions would stay float. (A report's process
    # rebuilding a model that is not torchvision's: the test above.)
    run = artifacts.create_run(tmp_path, "timm")
    train.run(TrainConfig(model="timm:test_resnet", image_size=16, epochs=1, precision="fp32",
                          baseline=False, measure_memory=False, quiet=True), run)
    quantize.run(QuantizeConfig(methods="ort-static", calibration_samples=64,
                                max_accuracy_drop=100, quiet=True), run)
    counts = run.entry("ort-static")["quantization"]["op_counts"]["Conv"]
    assert counts["int8"] >= 5 and counts["float"] == 0, counts


@pytest.mark.slow
def test_an_imported_checkpoint_is_the_fp32_source_of_quantize_and_report(tiny_run, tmp_path):
    trained = loading.load_checkpoint(tiny_run["run"].verified_path("fp32"))["state_dict"]
    checkpoint = tmp_path / "elsewhere.pt"
    torch.save({"epoch": 7, "model_state_dict": {f"module.{k}": v for k, v in trained.items()}},
               checkpoint)
    result = CliRunner().invoke(cli, ["--artifacts-dir", str(tmp_path / "artifacts"), "--quiet",
                                      "--run", "imported", "import", "--model", "smallcnn",
                                      "--weights", str(checkpoint), "--image-size", "8", *QUICK])
    assert result.exit_code == 0, result.stderr[-2000:]
    run = artifacts.open_run(tmp_path / "artifacts", "imported")
    entry = run.entry("fp32")
    assert entry["stage"] == "import" and "amp" not in run.artifacts()
    assert entry["imported_from"]["sha256"] == files.sha256_file(checkpoint)
    assert run.entry("onnx-fp32")["parent"] == "fp32"
    models = {m["name"]: m for m in _report(tmp_path, "imported")["models"]}
    assert models["fp32"]["accuracy"] == pytest.approx(tiny_run["train"]["fp32"].test_accuracy)
    assert _report(tmp_path, "imported")["training"] == {}


def test_import_refuses_weights_that_do_not_fit_naming_the_key(tiny_run, tmp_path):
    trained = loading.load_checkpoint(tiny_run["run"].verified_path("fp32"))["state_dict"]
    trained["12.weight"] = torch.zeros(5, 64)  # a classifier for 5 classes, not 10
    path = tmp_path / "five.pt"
    torch.save(trained, path)
    run = artifacts.create_run(tmp_path / "artifacts", "bad")
    with pytest.raises(PipelineError, match=r"'12.weight' has shape \(5, 64\), the model needs "
                                            r"\(10, 64\)"):
        import_model.run(ImportConfig(model="smallcnn", weights=str(path), image_size=8,
                                      quiet=True), run)
    assert "fp32" not in run.artifacts()


def test_batchnorm_weights_saved_without_num_batches_tracked_load_as_torch_loads_them():
    """BatchNorm state from before torch 0.4.1 (torchvision's first ImageNet weights) has no
    num_batches_tracked; load_state_dict fills it with 0, and --weights and import had refused
    the file for the missing key."""
    from stages.models.build import build_model

    model = build_model("smallcnn", 10, 1)
    old = {k: v for k, v in model.state_dict().items() if "num_batches_tracked" not in k}
    fresh = build_model("smallcnn", 10, 1)
    assert weights.load_into(fresh, old, "old.pth", adapt=False) == []
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in old.items())
    old.pop("1.running_mean")  # a key that is really missing is still named
    with pytest.raises(PipelineError, match="'1.running_mean' is missing from it"):
        weights.load_into(fresh, old, "old.pth", adapt=False)


def test_import_from_an_image_folder_that_is_not_there_names_the_folder(tiny_run, tmp_path):
    """A mistyped --data-dir had built a model of ten guessed classes and blamed the weights
    (five classes here) for not fitting it."""
    trained = loading.load_checkpoint(tiny_run["run"].verified_path("fp32"))["state_dict"]
    trained["12.weight"] = torch.zeros(5, 64)
    torch.save(trained, tmp_path / "five.pt")
    with pytest.raises(PipelineError, match=r"photoz is not a folder; point --data-dir at"):
        import_model.preflight(ImportConfig(model="smallcnn", weights=str(tmp_path / "five.pt"),
                                            dataset="imagefolder", image_size=8,
                                            data_dir=str(tmp_path / "photoz")))


def test_starting_weights_replace_the_classifier_and_adapt_the_first_convolution(tmp_path):
    from torch import nn

    source = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                           nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, bias=False),
                           nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                           nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 1000))
    path = tmp_path / "rgb-imagenet-head.pt"
    torch.save(source.state_dict(), path)
    run = artifacts.create_run(tmp_path / "artifacts", "init")
    (result,) = train.run(TrainConfig(model="smallcnn", image_size=8, epochs=1, baseline=False,
                                      init_weights=str(path), lr=0.05, measure_memory=False,
                                      quiet=True), run)
    notes = run.entry("amp")["initial_weights"]["adapted"]
    assert notes == ["0.weight: 3 input channel(s) adapted to 1",
                     "12.weight (1000, 64) replaced by a new (10, 64) for this data's classes",
                     "12.bias (1000,) replaced by a new (10,) for this data's classes"]
    first = loading.load_checkpoint(run.verified_path("amp/checkpoint-last"))
    assert result.test_accuracy > 0.3 and first["model"]["0.weight"].shape == (16, 1, 3, 3)


def test_pretrained_weights_not_in_the_cache_say_where_they_were_looked_for(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    with pytest.raises(PipelineError) as raised:
        weights.pretrained_file("resnet18", "IMAGENET1K_V1")
    message = str(raised.value)
    assert str(tmp_path / "torch-home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message
    assert "nothing is downloaded" in message

"""Quantization-aware training: frozen BatchNorm statistics, and what the qat stage leaves."""
import copy
import json
import os

import onnx
import pytest
import torch

from pipeline.config import QatConfig, TrainConfig
from stages import qat, runtimes
from stages.data.datasets import load_splits
from stages.run.errors import PipelineError
from stages.runtimes import onnx_export, pt2e, qdq_onnx
from stages.runtimes import qat as qat_runtime
from stages.training import batchnorm
from stages.training import loop as training_loop
from tests.conftest import TINY_TRAIN

# One worker runs them all (tests/conftest.py): tiny_qat_run and torchao's pattern exports,
# about 24 s the first time a process runs QAT, are then made once.
pytestmark = pytest.mark.xdist_group("qat")


def test_the_qat_tests_share_one_worker(request):
    """xdist groups by a suffix it writes into the node id; pytest 9.2 ignores the write
    (pytest-dev/pytest-xdist#1386), and the group then ran on both workers, each making
    tiny_qat_run and QAT's exports (56 s and 51 s of set-up on a 2-core Zen 4; pyproject.toml
    pins pytest below 9.2). In one process (-n 0) there is no group to keep."""
    under_xdist = "PYTEST_XDIST_WORKER" in os.environ
    assert request.node.nodeid.endswith("@qat") or not under_xdist, request.node.nodeid


@pytest.mark.slow
def test_frozen_batchnorm_keeps_its_statistics_while_training_goes_on():
    from stages.models.builtin import smallcnn

    spec = {"model": "smallcnn", "num_classes": 10, "in_channels": 1, "image_size": 8}
    graph = pt2e.export_graph(smallcnn(10, 1), spec, train=True)
    prepared = pt2e.prepare_qat(graph, pt2e.pt2e_options())
    images = load_splits(TrainConfig(**TINY_TRAIN)).train.tensors[0][:64]
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        prepared(images).logsumexp(1).mean().backward()
        optimizer.step()

    def statistics():
        return {k: v.clone() for k, v in prepared.state_dict().items() if "running" in k}

    step()
    before = statistics()
    step()
    moved = statistics()
    assert before and any(not torch.equal(before[k], moved[k]) for k in before)
    batchnorm.freeze_graph(prepared)
    weights = copy.deepcopy([p.detach() for p in prepared.parameters()])
    step()
    step()
    assert all(torch.equal(moved[k], v) for k, v in statistics().items())
    assert any(not torch.equal(a, b.detach()) for a, b in zip(weights, prepared.parameters()))


@pytest.mark.slow
def test_the_qat_stage_leaves_a_checked_int8_model(tiny_qat_run):
    from tests.stages.test_quantize import stored_weight_bytes

    run = tiny_qat_run["run"]
    entry = run.entry("torch-qat")
    info = entry["quantization"]
    assert entry["stage"] == "qat" and entry["parent"] == "amp"
    assert info["qat"] is True and [h["epoch"] for h in info["history"]] == [1]
    assert info["options"]["observer"] == "moving average (fake quantization)"  # not histogram
    # --tuning-time cut the three epochs asked to the one run, and the freezes with them.
    assert (info["epochs_asked"], info["epochs"], info["tuning_time_s"]) == (3, 1, 1e-3)
    assert (info["freeze_bn_after"], info["freeze_observers_after"]) == (1, 1)
    assert info["op_counts"]["Conv"] == {"int8": 3, "float": 0}
    assert info["parity_vs_source"]["top1_agreement"] > 0.5
    # Inductor's int8 kernels against the graph they were compiled from, on the check images
    assert info["compiled_vs_graph"]["samples"] == 128
    assert info["compiled_vs_graph"]["top1_agreement"] >= 0.9
    stored = stored_weight_bytes(run, "torch-qat")
    assert stored["int8"] == stored["float_model_weights"] // 4  # every weight, in one byte
    assert stored["float"] < 0.1 * stored["float_model_weights"]  # scales and biases only
    config = json.loads((run.root / "config.json").read_text())
    assert config["qat"]["source"] == "amp"


@pytest.mark.slow
def test_a_fine_tuned_model_is_judged_on_the_validation_split_alone(tiny_qat_run):
    from stages import runtimes
    from stages.data.datasets import splits_of_run
    from stages.data.subsets import validation_halves
    from stages.measure.evaluate import predict_dataset

    run, data = tiny_qat_run["run"], tiny_qat_run["report"]
    splits = splits_of_run(run)
    choosing, judging = validation_halves(len(splits.val))
    assert not set(choosing) & set(judging) and len(judging) == len(splits.val) // 2
    models = {m["name"]: m for m in data["models"]}
    fine_tuned = {"torch-qat", "ort-qat", "openvino-qat"} & set(models)
    assert "torch-qat" in fine_tuned
    # tiny_run trains amp in bf16: the fp32 baseline is another training, judged on the
    # validation split alone, on which both chose their epoch.
    reference = data["reference"]
    assert reference == "amp"
    for name, model in models.items():
        judged = model["validation"]
        if name in fine_tuned:
            assert (judged["samples"], judged["images"]) == (len(judging), (
                "the half of the validation split qat did not choose its epoch on"))
        elif name == "fp32":
            assert (judged["samples"], judged["images"]) == (len(splits.val), "validation split")
        else:  # training images too
            assert judged["samples"] > len(splits.val), name
            assert judged["images"] == "validation split and held-out training images", name
            assert judged["change_vs_reference"]["difference"] == pytest.approx(
                judged["accuracy"] - models[reference]["validation"]["accuracy"])
    # Paired with the reference on the same images: its accuracy on those images alone.
    logits, labels = predict_dataset(runtimes.load(run, reference, 1).predict, splits.val)
    hits = (logits.argmax(1) == labels)
    for name, images in [(n, judging) for n in fine_tuned] + [("fp32", range(len(splits.val)))]:
        judged = models[name]["validation"]
        reference_there = hits[list(images)].sum().item() / len(images)
        assert judged["change_vs_reference"]["difference"] == pytest.approx(
            judged["accuracy"] - reference_there)
    verdict = data["verdict"]
    assert verdict["chosen_on"] == models[verdict["recommended"]]["validation"]["images"]
    markdown_text = (run.root / "report" / "report.md").read_text()
    names = ", ".join(f"`{n}`" for n in ("torch-qat", "ort-qat", "openvino-qat")
                      if n in fine_tuned)
    assert (f"Judged on {len(judging)} validation images alone: {names}, the half of the "
            "validation split qat did not choose its epoch on.") in markdown_text
    assert ("`torch-qat` was fine-tuned for 1 of the 3 epochs asked: --tuning-time 0.001s "
            "allowed no more.") in markdown_text  # tiny_qat_run's cut
    assert (f"`fp32` was trained apart from `amp`, which every other variant is made from: it "
            f"is judged on the {len(splits.val)} images of the validation split alone") in (
                markdown_text)


@pytest.mark.slow
def test_ort_and_openvino_qat_are_kept_only_where_they_agree_with_torch_qat(
        tiny_qat_run, tmp_path, monkeypatch, capsys):
    """ort-qat and openvino-qat (read from it) are kept with their parity recorded where their
    runtime agrees with torch-qat on 98% of the check images, refused below with their files
    removed; without OpenVINO, openvino-qat is not made and the stage says why. The gate is
    given each runtime's agreement by name; the fine-tuning it follows is the fixture's."""
    from stages.runtimes import openvino as openvino_runtime
    from stages.runtimes.context import context
    from tests.conftest import _copy

    real = qat_runtime.parity_with_torch_qat
    cases = [({"ort-qat": 1.0, "openvino-qat": 1.0}, True, ["ort-qat", "openvino-qat"]),
             ({"ort-qat": 0.97, "openvino-qat": 1.0}, True, []),
             ({"ort-qat": 1.0, "openvino-qat": 0.97}, True, ["ort-qat"]),
             ({"ort-qat": 1.0, "openvino-qat": 1.0}, False, ["ort-qat"])]
    for number, (agreements, openvino, kept) in enumerate(cases):
        run = _copy(tiny_qat_run["run"], tmp_path / str(number))
        for name in ("ort-qat", "openvino-qat"):
            run.unregister(name)
        monkeypatch.setattr(qat_runtime, "parity_with_torch_qat", lambda name, ref, logits,
                            given=agreements: real(name, ref, logits) | {
                                "top1_agreement": given[name]})
        if not openvino:
            def missing():
                raise PipelineError("OpenVINO is not installed: pip install openvino nncf")
            monkeypatch.setattr(openvino_runtime, "_openvino", missing)
        with context(run, QatConfig(epochs=1), "qat") as ctx:
            for name in ("ort-qat", "openvino-qat"):
                runtimes.VARIANTS[name].make(ctx, None)
        err = capsys.readouterr().err
        assert [n for n in ("ort-qat", "openvino-qat") if n in run.artifacts()] == kept
        for name in kept:
            parity = run.entry(name)["quantization"]["parity_vs_torch_qat"]
            assert parity["top1_agreement"] == agreements[name]
        if "ort-qat" in kept:
            assert "QuantizeLinear" in {n.op_type for n in onnx.load(
                str(run.verified_path("ort-qat"))).graph.node}
        if "openvino-qat" in kept:
            entry = run.entry("openvino-qat")
            assert entry["parent"] == "ort-qat" and entry["stage"] == "qat"
            assert entry["quantization"]["op_counts"]["Conv"] == {"int8": 3, "float": 0}
        if agreements["ort-qat"] < 0.98:
            assert not (run.root / "quantize" / "ort-qat.onnx").exists()
            assert "qat: ort-qat not kept: ONNX Runtime agrees with torch-qat on only 97.0%" in err
            assert "qat: openvino-qat not made: it is read from ort-qat, which was not kept" in err
        elif agreements["openvino-qat"] < 0.98 and openvino:
            assert not (run.root / "quantize" / "openvino-qat.xml").exists()
            assert "qat: openvino-qat not kept: OpenVINO agrees with torch-qat on only 97.0%" in err
        elif not openvino:
            assert "qat: openvino-qat not made: OpenVINO is not installed" in err
        monkeypatch.undo()


def test_batchnorm_statistics_of_the_qat_graph_are_recomputed_from_training_images():
    """MNASNet-like momentum (0.0003): a few steps leave the running statistics where they
    were; recomputing sets them to the average over the images' batches, as the float
    model's own BatchNorm computes it with momentum None."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=0.0003), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    spec = {"model": "test", "num_classes": 10, "in_channels": 1, "image_size": 8}
    graph = pt2e.export_graph(copy.deepcopy(model), spec, train=True)
    splits = load_splits(TrainConfig(**TINY_TRAIN))
    batchnorm.recompute_graph(graph, splits.calibration, 64, torch.device("cpu"))
    running = {k: v.clone() for k, v in graph.state_dict().items() if "running" in k}
    assert len(running) == 2

    expected = copy.deepcopy(model[:2])  # the float module's, PyTorch's cumulative average
    batchnorm.recompute_module(expected, splits.calibration, 64, torch.device("cpu"))
    mean = next(v for k, v in running.items() if k.endswith("running_mean"))
    var = next(v for k, v in running.items() if k.endswith("running_var"))
    assert not torch.allclose(expected[1].running_mean, torch.zeros(4))  # it did move
    torch.testing.assert_close(mean, expected[1].running_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(var, expected[1].running_var, rtol=1e-4, atol=1e-5)
    # The graph's own arguments are restored: training mode, the model's momentum.
    (node,) = [n for n in graph.graph.nodes if str(n.target) in batchnorm.GRAPH_OPS]
    assert node.args[5] is True and node.args[6] == 0.0003
    assert "True, 0.0003," in graph.code  # and in the code the graph runs


@pytest.mark.slow
def test_the_last_epoch_kept_is_handed_on_as_scored_with_the_observers_off(tiny_run, tmp_path,
                                                                             monkeypatch):
    """Validation images never move the quantization ranges: each epoch is scored with the
    observers off, on the half of the validation split that the report does not judge
    torch-qat on. --freeze-observers-after past the epochs: the observers never freeze and each
    epoch's end lets them go on again. Epoch 1 leads the last by one image, within noise, so
    the last epoch's weights stay: they must reach the makers as they were scored, observers
    off (a forward before convert, as an export's, would otherwise move the ranges)."""
    from tests.conftest import _copy

    run = _copy(tiny_run["run"], tmp_path / "artifacts")
    wrong = iter([1, 2])  # images wrong at epochs 1 and 2
    scored = []  # (observer flags, images) of each scoring

    def observers(model):
        return [int(m.observer_enabled) for m in model.modules()
                if hasattr(m, "observer_enabled")]

    def hits(model, dataset, device=None):
        scored.append((observers(model), len(dataset)))
        return torch.arange(len(dataset)) >= next(wrong)

    handed = []

    class Handed(Exception):
        """Raised where the graph reaches the makers: what they make is tested elsewhere."""

    def fine_tuned(graph, record):
        handed.append((record["chosen"], observers(graph)))
        raise Handed

    monkeypatch.setattr(qat, "dataset_hits", hits)
    monkeypatch.setattr(qat.qat_runtime, "FineTuned", fine_tuned)
    with pytest.raises(Handed):
        qat.run(QatConfig(epochs=2, freeze_bn_after=1, freeze_observers_after=3, quiet=True),
                run)
    assert [size for _, size in scored] == [72, 72]  # the half of 144 that qat chooses on
    assert all(flags and not any(flags) for flags, _ in scored)
    (chosen, observing), = handed
    assert chosen.startswith("epoch 2, the last: epoch 1 scored +1.4 points")
    assert observing and not any(observing)


def _one_signed_conv_net():
    """A conv whose output channels have weights of one sign each, as depthwise 3x3 filters
    often do after BatchNorm is folded into them, then BatchNorm, ReLU and a classifier."""
    from torch import nn

    torch.manual_seed(0)
    conv = nn.Conv2d(1, 4, 3, bias=False)
    with torch.no_grad():
        magnitude = torch.rand_like(conv.weight) * 0.5 + 0.05
        conv.weight.copy_(magnitude * torch.tensor([1.0, -1.0, 1.0, -1.0]).view(4, 1, 1, 1))
    # 4 x 6 x 6 from 8 x 8 images
    return nn.Sequential(conv, nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10))


@pytest.mark.slow
def test_qat_trains_with_the_weight_quantization_it_deploys():
    """Every fake quantizer of the QAT graph quantizes with the scale and zero point that
    convert_pt2e will deploy (it asks each one's observer). torchao 0.18's fused fake-quant
    kernel made one-signed weight channels affine: zero point +-127/128 and half the step of
    the symmetric int8 that is deployed."""
    spec = {"model": "net", "num_classes": 10, "in_channels": 1, "image_size": 8}
    prepared = qat_runtime.prepare(_one_signed_conv_net(), spec, torch.device("cpu"))
    with torch.no_grad():
        prepared(torch.rand(64, 1, 8, 8))  # the observers see the images once
    qat_runtime.observe(prepared, False)
    quantizers = [m for m in prepared.modules() if hasattr(m, "fake_quant_enabled")]
    weights = [m for m in quantizers if m.qscheme == torch.per_channel_symmetric]
    assert len(quantizers) == 4 and len(weights) == 2  # input, conv and linear weights, ReLU
    for quantizer in quantizers:
        scale, zero_point = quantizer.calculate_qparams()
        assert torch.equal(quantizer.scale, scale)
        assert torch.equal(quantizer.zero_point, zero_point.to(quantizer.zero_point.dtype))
    assert all(not m.zero_point.any() for m in weights)


def test_freezing_points_scale_with_the_epochs_unless_given():
    assert [(c.freeze_bn_after, c.freeze_observers_after)
            for c in (QatConfig(), QatConfig(epochs=3), QatConfig(epochs=1))] == [
                (5, 7), (1, 2), (1, 1)]
    assert QatConfig(epochs=4, freeze_bn_after=0).freeze_bn_after == 0  # BN frozen from the start
    with pytest.raises(ValueError, match="--freeze-observers-after"):
        QatConfig(freeze_observers_after=0)  # quantization ranges would never be measured


@pytest.mark.slow
def test_weights_that_diverge_mid_epoch_are_one_clear_error(tmp_path, monkeypatch):
    """mnasnet0_5 on notMNIST: NaN weights reached a torchao observer, whose assertion (min <=
    max) came out as a traceback before the epoch's loss check could name the cause. Here the
    weights really turn NaN and torchao's own observer asserts; any other assertion, with the
    model finite, still comes out as it is."""
    from stages import train
    from stages.run import artifacts
    from stages.run.errors import Diverged

    run = artifacts.create_run(tmp_path, "diverges")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "baseline": False}), run)
    real_step, steps = training_loop.train_step, []

    def unrelated_assertion_at_the_second_step(parts, *args):
        steps.append(args[-1])
        if len(steps) == 2:
            raise AssertionError("not about divergence")
        real_step(parts, *args)

    monkeypatch.setattr(training_loop, "train_step", unrelated_assertion_at_the_second_step)
    with pytest.raises(AssertionError, match="^not about divergence$"):
        qat.run(QatConfig(epochs=2, quiet=True), run)

    def weights_nan_after_the_second_step(parts, *args):
        real_step(parts, *args)
        steps.append(args[-1])
        if len(steps) == 2:
            with torch.no_grad():
                next(parts.model.parameters()).fill_(float("nan"))

    steps.clear()
    monkeypatch.setattr(training_loop, "train_step", weights_nan_after_the_second_step)
    with pytest.raises(Diverged, match=r"^qat: the fake-quantized model diverged at epoch 1 "
                       r"step 3: its weights or activations became NaN or infinite; "
                       r"lower --lr \(now 0.005\)$"):  # auto fine-tunes in fp32 already
        qat.run(QatConfig(epochs=2, quiet=True), run)
    assert "torch-qat" not in run.artifacts()

    def weights_nan_after_the_epochs_last_step(parts, *args):  # then scored: an observer
        real_step(parts, *args)  # asserted in the BatchNorm statistics' pass, raw
        if args[-1] == parts.steps_per_epoch - 1:
            with torch.no_grad():
                next(parts.model.parameters()).fill_(float("nan"))

    monkeypatch.setattr(training_loop, "train_step", weights_nan_after_the_epochs_last_step)
    with pytest.raises(Diverged, match=r"^qat: the fake-quantized model diverged at epoch 1 "):
        qat.run(QatConfig(epochs=2, quiet=True), run)


def test_a_cut_plan_records_each_freeze_where_it_can_still_be():
    """Cut to 4 epochs after 4 (10, 10, 10, then 70 s of 100), the plan had recorded BatchNorm
    and the ranges "frozen after 2", which no epoch was."""
    from stages.training.plans import Plan, replanned

    assert replanned(Plan(10, 5, 7), Plan(4, 2, 2), done=4) == Plan(4, 4, 4)
    assert replanned(Plan(10, 5, 7), Plan(6, 3, 4), done=2) == Plan(6, 3, 4)  # both to come
    assert replanned(Plan(10, 2, 7), Plan(6, 1, 4), done=3) == Plan(6, 2, 4)  # BN's was made


def test_tuning_time_cuts_the_epochs_to_what_fits_and_scales_the_freezes_alike():
    from stages.training.plans import Plan, fitted_plan

    three_minutes = QatConfig(tuning_time="3m")  # 10 epochs; BN frozen after 5, ranges after 7
    assert fitted_plan(three_minutes, 1, 150.0) == Plan(1, 1, 1)  # efficientnet_b0's pace here
    assert fitted_plan(three_minutes, 1, 50.0) == Plan(3, 1, 2)
    assert fitted_plan(three_minutes, 2, 60.0) == Plan(6, 3, 4)  # the pace of the epochs so far
    assert fitted_plan(three_minutes, 1, 10.0) == Plan(10, 5, 7)  # never more than asked
    assert fitted_plan(three_minutes, 4, 400.0) == Plan(4, 2, 2)  # never fewer than run
    assert fitted_plan(QatConfig(), 1, 1e6) == Plan(10, 5, 7)  # no limit: as asked
    assert fitted_plan(QatConfig(epochs=4, freeze_bn_after=0, tuning_time=60), 1, 30.0) == Plan(
        2, 0, 1)  # BN frozen from the start stays so


RANDOM_NETS = """
import torch
import torch.nn as nn
from torchvision.ops import StochasticDepth


class Residual(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.drop = StochasticDepth(0.5, "row")

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


class Noise(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.randn_like(x) if self.training else x


def _net(num_classes, in_channels, *middle):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), *middle,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


def deep(num_classes, in_channels):
    return _net(num_classes, in_channels, Residual(8), Residual(8))


def noisy(num_classes, in_channels):
    return _net(num_classes, in_channels, Noise())


class Basic(nn.Module):  # resnet's block end: a conv's output meets the identity in an Add
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn(self.conv(x)))


def residual(num_classes, in_channels):
    return _net(num_classes, in_channels, Basic(8), Basic(8))
"""


def _user_run(tmp_path, monkeypatch, factory, precision="auto", epochs=1):
    from stages import train
    from stages.run import artifacts

    (tmp_path / "qat_random_nets.py").write_text(RANDOM_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = artifacts.create_run(tmp_path / "artifacts", factory)
    train.run(TrainConfig(**TINY_TRAIN | {"model": f"qat_random_nets:{factory}", "epochs": epochs,
                                          "baseline": False, "precision": precision}), run)
    return run


@pytest.mark.slow
def test_qat_asked_for_bf16_on_a_model_it_cannot_take_says_why_in_one_line(tmp_path,
                                                                           monkeypatch):
    """The "deep" net's first ReLU has no BatchNorm before it: fine-tuned under bf16 autocast,
    it feeds a fake quantizer bfloat16, which torchao refuses (torch's own error had ended the
    stage)."""
    run = _user_run(tmp_path, monkeypatch, "deep")
    with pytest.raises(PipelineError, match=r"qat --precision bf16 failed \(.*\): torchao's fake "
                                            "quantizers take float32 alone.* fine-tune with "
                                            r"--precision fp32 \(or auto\)"):
        qat.run(QatConfig(epochs=1, quiet=True, precision="bf16"), run)


@pytest.mark.slow
def test_stochastic_depth_is_off_in_fine_tuning_so_the_int8_model_is_deterministic(
        tmp_path, monkeypatch):
    """Exported for training, StochasticDepth becomes bernoulli_ ops that eval mode keeps:
    efficientnet_b0's torch-qat drew new predictions on every call. Trained in bf16: its
    first ReLU, with no BatchNorm before it, fed a fake quantizer bfloat16 when fine-tuning
    followed the training's precision, which torchao's fused observer refuses."""
    run = _user_run(tmp_path, monkeypatch, "deep", precision="bf16")
    qat.run(QatConfig(epochs=1, quiet=True), run)
    info = run.entry("torch-qat")["quantization"]
    assert info["precision"] == "fp32"
    assert info["stochastic_depth_off"] == ["2.drop", "3.drop"]
    graph = pt2e.load_pt2e(run, "torch-qat")
    assert not [n for n in graph.graph.nodes if "bernoulli" in str(n.target)]
    images = load_splits(TrainConfig(**TINY_TRAIN)).val.tensors[0][:64]
    assert torch.equal(graph(images), graph(images))


@pytest.mark.slow
def test_a_model_that_stays_random_in_eval_mode_is_refused_before_fine_tuning(
        tmp_path, monkeypatch):
    run = _user_run(tmp_path, monkeypatch, "noisy")
    with pytest.raises(PipelineError, match=r"qat: qat_random_nets:noisy draws random numbers "
                                            r"in training that stay in its exported graph in "
                                            r"eval mode \(aten\.randn_like\.default\)"):
        qat.run(QatConfig(epochs=1, quiet=True), run)
    assert "torch-qat" not in run.artifacts()


@pytest.mark.slow
def test_ort_qat_runs_every_conv_and_linear_in_int8_where_a_conv_meets_a_residual_add(
        tmp_path, monkeypatch):
    """torchao leaves no QuantizeLinear between a conv and the Add it meets (Inductor fuses
    them), and ONNX Runtime then ran such a conv in float: resnet18's ort-qat had 8 of its 20
    convs in float and ran at 0.40x the fastest float. Each gets a QDQ pair observed on
    training images, and the model is kept (at 98% agreement with torch-qat)."""
    # Trained past chance: at 22% after one epoch, its logits were so close that three of 128
    # images flipped between ONNX Runtime and torch-qat on a logit difference of 0.015.
    run = _user_run(tmp_path, monkeypatch, "residual", epochs=4)
    qat.run(QatConfig(epochs=1, quiet=True), run)
    info = run.entry("ort-qat")["quantization"]
    assert info["conv_outputs_quantized_before_adds"] == 2
    assert info["op_counts"]["Conv"] == {**info["op_counts"]["Conv"], "int8": 3, "float": 0}
    # The classifier's float bias is now int32 too, so its Gemm runs in int8 as well.
    assert info["linear_biases_quantized"] == 1
    assert info["op_counts"]["Linear"] == {"int8": 1, "float": 0, "ops": {"QGemm": 1}}
    model = onnx.load(str(run.verified_path("ort-qat")))
    assert qdq_onnx.conv_outputs_into_adds(model) == []
    # The export alone has both: the two block-end convs feed their Adds unquantized.
    torch_qat = pt2e.load_pt2e(run, "torch-qat")
    exported = tmp_path / "exported.onnx"
    images = load_splits(TrainConfig(**TINY_TRAIN)).val.tensors[0][:2]
    onnx_export.export_onnx(torch_qat, images, exported)
    assert len(qdq_onnx.conv_outputs_into_adds(onnx.load(str(exported)))) == 2


def test_the_qat_variants_are_registered_like_every_other_and_listed_with_their_runtime():
    """torch-qat, ort-qat and openvino-qat are registered by runtimes/qat.py, after every
    runtime module, and still listed (in the report too) with their own runtime's variants,
    where they were before; quantize neither offers nor makes them."""
    from stages import quantize, runtimes

    names = list(runtimes.VARIANTS)
    made_by_qat = [n for n in names if runtimes.VARIANTS[n].stage == "qat"]
    assert made_by_qat == ["torch-qat", "ort-qat", "openvino-qat"]
    assert names.index("torch-qat") == names.index("torch-static") + 1
    assert names.index("ort-qat") == names.index("ort-static") + 1
    assert names[-2:] == ["openvino-int8", "openvino-qat"]
    assert not set(made_by_qat) & set(runtimes.made_by_quantize())
    assert runtimes.VARIANTS["ort-qat"].source == "torch-qat"
    assert runtimes.VARIANTS["openvino-qat"].source == "ort-qat"
    with pytest.raises(PipelineError, match="torch-qat cannot be made by quantize"):
        quantize.plan(_NoArtifacts(), ("torch-qat",))


class _NoArtifacts:
    """A run with a float model and nothing made from it."""

    def artifacts(self):
        return {"amp": {}}


@pytest.mark.slow
def test_a_qat_that_fails_part_way_leaves_no_variant_of_the_fine_tuning_it_replaced(
        tiny_qat_run, tmp_path, monkeypatch):
    """ort-qat's making fails after torch-qat is made again: the earlier fine-tuning's
    openvino-qat must not stand listed beside the new torch-qat (it was unregistered only just
    before its own making, which never came)."""

    from tests.conftest import _copy

    run = _copy(tiny_qat_run["run"], tmp_path / "artifacts")
    assert "openvino-qat" in run.artifacts()
    monkeypatch.setattr(qat, "CHILD", "tests.stages.crashing_child:qat_failing")
    with pytest.raises(PipelineError, match="ort-qat: failed"):
        qat.run(QatConfig(epochs=1, quiet=True), run)
    assert not {"ort-qat", "openvino-qat"} & set(run.artifacts())


@pytest.mark.slow  # tiny_qat_run
def test_a_qat_variant_its_runtime_cannot_take_costs_that_variant_not_the_stage(
        tiny_qat_run, tmp_path, monkeypatch):
    """OpenVINO's compiler refusing openvino-qat had failed the stage after torch-qat was
    listed (and quantize --auto then said QAT made nothing, with torch-qat in the manifest)."""
    from tests.conftest import _copy

    run = _copy(tiny_qat_run["run"], tmp_path / "artifacts")
    # ort-qat kept whatever its parity, so that openvino-qat is tried, and refused.
    monkeypatch.setattr(qat, "CHILD", "tests.stages.crashing_child:qat_openvino_refusing")
    made = qat.run(QatConfig(epochs=1, quiet=True), run)
    assert made == ["torch-qat", "ort-qat"]
    assert made[0] == "torch-qat" and "openvino-qat" not in made
    assert [n for n in ("torch-qat", "ort-qat", "openvino-qat") if n in run.artifacts()] == made


@pytest.mark.slow  # tiny_qat_run
def test_an_ort_qat_with_nothing_in_int8_is_not_kept_and_the_stage_goes_on(
        tiny_qat_run, tmp_path, monkeypatch, capsys):
    """It failed the stage (register's "nothing runs in int8", an error to report) after
    torch-qat was listed, where openvino-qat in the same case is only not kept."""
    from stages.runtimes import qat as qat_runtime
    from tests.conftest import _copy

    run = _copy(tiny_qat_run["run"], tmp_path / "artifacts")
    run.unregister("openvino-qat")
    run.unregister("ort-qat")
    counted = []
    monkeypatch.setattr(qat_runtime, "onnx_op_counts",
                        lambda path: counted.append(path) or {"Conv": {"int8": 0, "float": 3}})
    # The child's work, here: ort-qat made from the run's torch-qat, without fine-tuning again.
    # Not kept for this reason, not another that returns nothing too (export, parity).
    assert qat._make_in_child(lambda _: None, QatConfig(quiet=False), run, ["ort-qat"]) == []
    assert counted and "qat: ort-qat not kept: ONNX Runtime runs none of its convolutions or " \
        "linear" in capsys.readouterr().err
    assert "ort-qat" not in run.artifacts() and "torch-qat" in run.artifacts()


@pytest.mark.slow
def test_a_runtime_that_crashes_while_a_qat_variant_is_made_costs_that_variant(
        tiny_qat_run, tmp_path, monkeypatch):
    """ort-qat's making dies of a real SIGSEGV: it had ended the stage (and quantize --auto
    with it); now torch-qat stands, ort-qat is not made and config.json's qat record says why,
    and openvino-qat, read from ort-qat, says it was not kept."""
    from tests.conftest import _copy

    run = _copy(tiny_qat_run["run"], tmp_path / "artifacts")
    monkeypatch.setattr(qat, "CHILD", "tests.stages.crashing_child:qat_crashing")
    made = qat.run(QatConfig(epochs=1, quiet=True), run)
    assert made == ["torch-qat"]
    assert [n for n in ("torch-qat", "ort-qat", "openvino-qat") if n in run.artifacts()] == made
    assert run.recorded_config("qat")["not_kept"] == {
        "ort-qat": "not made: its runtime crashed (SIGSEGV) while it was made",
        "openvino-qat": "not made: it is read from ort-qat, whose runtime crashed"}
    assert not list((run.root / "quantize").glob(".*"))  # the crashed child's scratch: gone

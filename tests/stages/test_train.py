import json


import torch

from pipeline.config import TrainConfig
from stages import artifacts, train
from tests.conftest import TINY_TRAIN


def _weights(run, variant):
    return artifacts.load_checkpoint(run.verified_path(variant))["state_dict"]


def test_amp_run_in_fp32_matches_the_baseline_bit_for_bit(tmp_path):
    """Same seed, initial weights, data order and hyperparameters: only precision differs."""
    run = artifacts.create_run(tmp_path, "same")
    train.run(TrainConfig(**TINY_TRAIN | {"epochs": 1, "precision": "fp32"}), run)
    fp32, amp = _weights(run, "fp32"), _weights(run, "amp")
    assert fp32.keys() == amp.keys()
    assert all(torch.equal(fp32[k], amp[k]) for k in fp32)


def test_outputs_of_a_training_run(tiny_run):
    run, results = tiny_run["run"], tiny_run["train"]
    assert results["fp32"].precision == "fp32" and results["amp"].precision == "bf16"
    for variant in ("fp32", "amp"):
        result = results[variant]
        assert result.test_accuracy > 0.5  # 10 classes: chance is 0.1
        assert result.samples_per_second > 0 and result.seconds > 0
        assert result.skipped_steps == 0
        lines = (run.root / "train" / variant / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
        checkpoint = artifacts.load_checkpoint(run.verified_path(f"{variant}/checkpoint-last"))
        assert {"model", "optimizer", "scheduler", "scaler", "position", "rng", "config"} <= set(checkpoint)
        assert checkpoint["position"]["epoch"] == 2 and checkpoint["position"]["step_in_epoch"] == 21
        assert all(v.dtype == torch.float32 for v in checkpoint["model"].values() if v.is_floating_point())
    # AMP does not make the saved model smaller: master weights are fp32 in both.
    assert run.entry("fp32")["bytes"] == run.entry("amp")["bytes"]


def test_fp16_with_grad_scaler_trains_on_cpu(tmp_path):
    run = artifacts.create_run(tmp_path, "fp16")
    (result,) = train.run(TrainConfig(**TINY_TRAIN | {"precision": "fp16", "baseline": False,
                                                       "grad_clip": 1.0}), run)
    assert result.precision == "fp16" and result.test_accuracy > 0.5
    assert result.optimizer_steps + result.skipped_steps == 2 * 21
    scaler_state = artifacts.load_checkpoint(run.verified_path("amp/checkpoint-last"))["scaler"]
    assert scaler_state["scale"] > 0
    assert "fp32" not in run.artifacts()


def test_same_seed_gives_identical_weights(tmp_path):
    config = TrainConfig(**TINY_TRAIN | {"epochs": 1, "baseline": False})
    first, second = artifacts.create_run(tmp_path, "a"), artifacts.create_run(tmp_path, "b")
    train.run(config, first)
    train.run(config, second)
    a, b = _weights(first, "amp"), _weights(second, "amp")
    assert all(torch.equal(a[k], b[k]) for k in a)


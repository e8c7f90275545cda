"""The recipe config.json records is the one build_parts trains with, and the report says it."""
import torch

from pipeline.config import TrainConfig
from stages.data.datasets import load_dataset
from stages.report.markdown import _recipe_sentence
from stages.training.loop import build_parts, recipe
from stages.training.precision import Precision
from tests.conftest import TINY_TRAIN


def test_the_recorded_recipe_is_what_the_training_parts_are_built_with():
    config = TrainConfig(**TINY_TRAIN | {"label_smoothing": 0.1, "weight_decay": 1e-4,
                                         "batch_size": 32, "epochs": 30})
    splits = load_dataset("digits", image_size=8, seed=0)
    parts = build_parts(config, splits, Precision("fp32"), torch.device("cpu"))
    said = recipe(config, splits)
    assert parts.criterion.label_smoothing == said["label_smoothing"] == 0.1
    assert parts.loader.batch_size == said["batch_size"] == 32
    sgd = parts.optimizer
    assert type(sgd).__name__ == "SGD" and said["optimizer"] == "SGD with Nesterov momentum 0.9"
    assert all(g["nesterov"] and g["momentum"] == 0.9 for g in sgd.param_groups)
    decayed, exempt = sgd.param_groups  # kernels decay; BatchNorm and biases do not
    assert decayed["weight_decay"] == said["weight_decay"] == 1e-4
    assert exempt["weight_decay"] == 0 and all(p.ndim <= 1 for p in exempt["params"])
    # A tenth of 30 epochs' steps is more than the two epochs the warm-up may take at most, as
    # the recipe says; the rate then falls to zero at the last step.
    steps = 30 * len(parts.loader)
    schedule = parts.scheduler.lr_lambdas[0]
    assert schedule.warmup_steps == 2 * len(parts.loader) and "at most 2 epochs" in said[
        "schedule"]
    assert schedule(steps) == 0.0 and schedule(schedule.warmup_steps) == 1.0
    assert said["augmentation"] == splits.augmentation == "none"  # the digits are not augmented


def test_the_report_says_the_recipe_in_words():
    splits = load_dataset("digits", image_size=8, seed=0)
    said = recipe(TrainConfig(**TINY_TRAIN), splits)
    assert _recipe_sentence(said) == (
        " SGD with Nesterov momentum 0.9, batches of 64, weight decay 0.0005 on weights and "
        "kernels (not BatchNorm or biases), linear warm-up over a tenth of the steps (at most 2 "
        "epochs), then a cosine to zero; no label smoothing; no averaging of weights; initial "
        "weights: the model's own; training images not augmented.")
    started = recipe(TrainConfig(**TINY_TRAIN | {"init_weights": __file__}), splits)
    assert started["initialisation"] == f"the weights in {__file__}"
    shifted = _recipe_sentence(said | {"label_smoothing": 0.1,
                                       "augmentation": "random shifts of up to 4 pixels"})
    assert "; label smoothing 0.1;" in shifted
    assert shifted.endswith("training images given random shifts of up to 4 pixels.")
    assert _recipe_sentence({}) == ""  # a run trained before the recipe was kept


def test_a_run_of_skipped_steps_goes_on_across_a_resume():
    """GradScaler's skips in a row carry across epochs, and now across a checkpoint: 20 before
    a stop and 10 after had passed --max-skipped-steps 25 resumed, and failed uninterrupted."""
    from stages.training.loop import Loop

    config = TrainConfig(**TINY_TRAIN)
    splits = load_dataset("digits", image_size=8, seed=0)
    cpu = torch.device("cpu")

    def loop():
        parts = build_parts(config, splits, Precision("fp32"), cpu)
        return Loop("amp", parts, Precision("fp32"), cpu, epochs=2, batch_size=64, quiet=True)

    stopped = loop()
    stopped.in_a_row = torch.tensor(20)
    resumed = loop()
    resumed.restore(stopped.state(), best=None)
    assert int(resumed.in_a_row) == 20

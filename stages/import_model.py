"""Import: register a model trained elsewhere as a run's `fp32` model, the source that
quantize then compresses (`pipeline import quantize report`).

The weights load weights-only and must fit the model exactly: nothing is adapted, since an
imported model is used as it is. The manifest records where they came from and their sha256,
and the model is scored on the run's validation and test splits so that a wrong --dataset or
--image-size shows at once.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from stages.data.datasets import expected_shape, load_splits, record_preprocessing
from stages.measure.evaluate import dataset_accuracy
from stages.models.build import build_model, check_model_fits, model_spec
from stages.models.weights import load_into, pretrained_file, read_state_dict
from stages.run.artifacts import Run
from stages.run.checkpoints import cpu_state_dict
from stages.run.files import atomic_torch_save, sha256_file
from stages.run.progress import say


def weights_file(config) -> Path:
    """--weights is a file, or the name of torchvision's pretrained weights in the cache."""
    path = Path(config.weights).expanduser()
    return path if path.is_file() else pretrained_file(config.model, config.weights, "--weights")


def preflight(config) -> None:
    """What can be refused before a run exists: a model that cannot take the data, and weights
    that are not a state_dict or do not fit the model."""
    import torch

    classes, channels, held = expected_shape(config)
    check_model_fits(config.model, classes, channels, config.image_size, 1, torch.device("cpu"),
                     held)
    path = weights_file(config)
    model = build_model(config.model, classes, channels, config.image_size)
    load_into(model, read_state_dict(path), str(path), adapt=False)


def run(config, run: Run) -> dict:
    import torch

    classes, channels, held = expected_shape(config)
    check_model_fits(config.model, classes, channels, config.image_size, 1, torch.device("cpu"),
                     held)
    path = weights_file(config)
    splits = load_splits(config)
    spec = model_spec(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    model = build_model(config.model, splits.num_classes, splits.in_channels, splits.image_size)
    load_into(model, read_state_dict(path), str(path), adapt=False)
    model.eval()
    scores = {"val_accuracy": dataset_accuracy(model, splits.val),
              "test_accuracy": dataset_accuracy(model, splits.test)}
    folder = run.root / "import"
    atomic_torch_save({"model_spec": spec, "state_dict": cpu_state_dict(model)},
                      folder / "model.pt")
    origin = {"file": str(path.resolve()), "sha256": sha256_file(path), "weights": config.weights}
    run.record_config("import", asdict(config))
    record_preprocessing(run, splits, config.dataset, "import")
    run.register("fp32", folder / "model.pt", kind="model", stage="import",
                 config=asdict(config), format="pytorch", model_spec=spec,
                 imported_from=origin, scores=scores, data=splits.identity())
    say(f"imported {config.model} from {path}: validation accuracy "
        f"{scores['val_accuracy']:.2%}, test accuracy {scores['test_accuracy']:.2%}",
        quiet=config.quiet)
    if scores["val_accuracy"] <= 1.5 / splits.num_classes:
        say(f"WARNING: the imported model scores at chance ({scores['val_accuracy']:.1%}) on "
            "this data: check --dataset, --image-size and --in-channels")
    return scores

"""Weights from elsewhere: a user's state_dict or checkpoint, or torchvision's pretrained
weights from the local cache, loaded weights-only into a model built for this data.

Starting training from them (--init-weights, --weights) adapts what must change with the data
and says so: a classifier for another number of classes is replaced, and a first convolution
for RGB is summed over its colour channels for grey images. Importing a model trained
elsewhere (pipeline import) adapts nothing: every shape must match.
"""
from __future__ import annotations

from pathlib import Path

from stages.models.build import initialisation
from stages.run.checkpoints import with_metadata
from stages.run.errors import PipelineError, UsageError
from stages.run.loading import load_checkpoint


def pretrained_file(model_name: str, weights_name: str,
                    file_flag: str = "--init-weights") -> Path:
    """The local file of torchvision's ``weights_name`` for ``model_name``; nothing is
    downloaded, so a missing file is an error that says where it was looked for. ``file_flag``
    is the flag that takes a file of weights instead (import's is --weights itself)."""
    import torch
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(model_name)
    except (KeyError, ValueError):
        raise UsageError(f"--weights: torchvision publishes no weights for {model_name!r}; "
                         f"use {file_flag} FILE") from None
    try:
        weights = enum[weights_name] if weights_name != "DEFAULT" else enum.DEFAULT
    except KeyError:
        known = ", ".join(["DEFAULT", *(w.name for w in enum)])
        raise UsageError(f"--weights {weights_name!r} is not one of {model_name}'s: {known}") \
            from None
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not path.is_file():
        raise PipelineError(f"--weights {weights.name}: {path} is not there and nothing is "
                            f"downloaded; fetch {weights.url} into that folder (or set "
                            f"TORCH_HOME), or use {file_flag} FILE")
    return path


def read_state_dict(path: Path) -> dict:
    """A state_dict from a weights-only file: a bare state_dict, or a checkpoint that holds
    one under 'model', 'state_dict' or 'model_state_dict'."""
    import torch

    data = load_checkpoint(path)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not data or not all(
            isinstance(v, torch.Tensor) for v in data.values()):
        raise PipelineError(f"{path} holds no state_dict (a mapping of names to tensors)")
    # DataParallel and DistributedDataParallel save their module's names with a prefix.
    if all(k.startswith("module.") for k in data):
        data = {k[len("module."):]: v for k, v in data.items()}
    return data


def _classifier_keys(model) -> set[str]:
    """Parameter names of the last layer that has parameters: the classifier."""
    names = [name for name, _ in model.named_parameters()]
    if not names:
        return set()
    owner = names[-1].rpartition(".")[0]
    return {n for n in model.state_dict() if n.rpartition(".")[0] == owner}


def _first_conv_weight(model) -> str | None:
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return f"{name}.weight" if name else "weight"
    return None


def load_into(model, loaded: dict, source: str, adapt: bool) -> list[str]:
    """Load ``loaded`` into ``model``; returns what was adapted, in words. With ``adapt``, a
    classifier of another shape keeps the model's fresh one and a first convolution for
    another number of input channels is summed or repeated; any other difference in names or
    shapes is an error that names the first key."""
    own = model.state_dict()
    # BatchNorm state saved before torch 0.4.1 (torchvision's first ImageNet weights among it)
    # has no num_batches_tracked: torch's own loading fills it with 0, and so does this.
    filled = {k: own[k].new_zeros(()) for k in own
              if k.endswith(".num_batches_tracked") and k not in loaded}
    missing = [k for k in own if k not in loaded and k not in filled]
    unexpected = [k for k in loaded if k not in own]
    if missing or unexpected:
        first = (f"{missing[0]!r} is missing from it" if missing
                 else f"{unexpected[0]!r} is not in the model")
        raise PipelineError(f"{source} does not fit {type(model).__name__}: {first} "
                            f"({len(missing)} missing, {len(unexpected)} unexpected keys); "
                            "check --model")
    notes, weights = [], dict(loaded) | filled
    classifier, first_conv = _classifier_keys(model), _first_conv_weight(model)
    for key, tensor in loaded.items():
        if tensor.shape == own[key].shape:
            continue
        if adapt and key in classifier:
            weights[key] = own[key]
            notes.append(f"{key} {tuple(tensor.shape)} replaced by a new "
                         f"{tuple(own[key].shape)} for this data's classes")
        elif adapt and key == first_conv and tensor.shape[0] == own[key].shape[0] \
                and tensor.shape[2:] == own[key].shape[2:]:
            want, have = own[key].shape[1], tensor.shape[1]
            if want == 1:
                weights[key] = tensor.sum(dim=1, keepdim=True)
            else:
                weights[key] = tensor.mean(dim=1, keepdim=True).repeat(1, want, 1, 1) * (
                    have / want)
            notes.append(f"{key}: {have} input channel(s) adapted to {want}")
        else:
            raise PipelineError(f"{source} does not fit the model: {key!r} has shape "
                                f"{tuple(tensor.shape)}, the model needs {tuple(own[key].shape)}"
                                + ("; check --model, --in-channels and the data set's classes"
                                   if not adapt else "; check --model"))
    model.load_state_dict(with_metadata({k: v.to(own[k].dtype) for k, v in weights.items()},
                                        loaded, own))
    return notes


def initial_weights(config, model) -> list[str]:
    """Load --init-weights or --weights (a TrainConfig's) into a freshly built model before
    training."""
    if config.init_weights:
        path = Path(config.init_weights).expanduser()
        return load_into(model, read_state_dict(path), str(path), adapt=True)
    if config.weights:
        path = pretrained_file(config.model, config.weights)
        return load_into(model, read_state_dict(path), f"{config.weights} ({path})",
                         adapt=True)
    return []


def starting_weights(config, splits) -> str:
    """What training starts from, in words for the run's recipe."""
    if config.init_weights:
        return f"the weights in {config.init_weights}"
    if config.weights:
        return f"torchvision's {config.weights} weights for {config.model}"
    return initialisation(config.model, splits.num_classes, splits.in_channels, splits.image_size)

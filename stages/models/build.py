"""Models by name: small built-ins, every torchvision classification model, timm's models
(`timm:NAME`) and a user's own (`package.module:factory`), adapted to the data.

What rebuilds a model is its name and three numbers (model_spec), stored with every checkpoint
and artifact, so a later stage builds the same architecture and loads the weights into it.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path
from typing import Callable

from stages.models.builtin import BUILTIN_MODELS
from stages.run.errors import PipelineError, UsageError

USER_MODEL = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# torchvision's own extras that only apply to its training recipes: auxiliary classifiers
# (GoogLeNet, Inception) return a tuple in training mode, which a plain loop cannot use.
TORCHVISION_OPTIONS = {"googlenet": {"aux_logits": False, "init_weights": False},
                       "inception_v3": {"aux_logits": False, "init_weights": False}}


def torchvision_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def known_models() -> list[str]:
    return sorted(BUILTIN_MODELS) + torchvision_models()


def describe_known() -> str:
    return (", ".join(known_models()) + "; also timm:NAME for timm's models and "
            "package.module:factory for your own")


def check_model_name(name: str) -> None:
    """Refuse a --model that cannot name a model, listing what can; imports nothing of the
    user's (that happens when the model is built)."""
    if name.startswith("timm:"):  # before the user-factory pattern, which it also matches
        timm = _timm()
        if name[5:] not in timm.list_models():
            raise ValueError(f"--model {name!r}: timm has no model {name[5:]!r}; see "
                             "timm.list_models()")
        return
    if name in BUILTIN_MODELS or USER_MODEL.match(name):
        return
    if name not in torchvision_models():
        raise ValueError(f"--model {name!r} is not one of: {describe_known()}")


def _timm():
    try:
        import timm
    except ImportError:
        raise UsageError("timm models need timm: pip install 'pipeline[timm]'") from None
    return timm


def _user_factory(name: str) -> Callable:
    """Import ``package.module:factory``; the current folder is searched first, as with
    `python -m`, so a model file beside the user's data is found."""
    module_name, _, attribute = name.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute)
    except ModuleNotFoundError as exc:
        if exc.name and module_name != exc.name and not module_name.startswith(exc.name + "."):
            # found, but what it imports is not installed: the advice below would mislead
            raise PipelineError(f"--model {name}: {module_name} imports {exc.name!r}, which is "
                                "not installed here; install it") from None
        raise PipelineError(f"--model {name}: cannot import it ({type(exc).__name__}: {exc}); "
                            "run from the folder that holds the module or install it, so that "
                            f"'import {module_name}' works") from None
    except (ImportError, AttributeError) as exc:
        raise PipelineError(f"--model {name}: cannot import it ({type(exc).__name__}: {exc}); "
                            "run from the folder that holds the module or install it, so that "
                            f"'import {module_name}' works") from None


def _call_factory(name: str, factory: Callable, num_classes: int, in_channels: int,
                  image_size: int):
    """Pass the keywords the factory declares among num_classes, in_channels, image_size."""
    offered = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        parameters = {}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    arguments = {k: v for k, v in offered.items() if takes_any or k in parameters}
    if "num_classes" not in arguments:
        raise PipelineError(f"--model {name}: the factory must take a num_classes keyword "
                            "(and may take in_channels and image_size)")
    import torch

    try:
        model = factory(**arguments)
    except (TypeError, AttributeError, KeyError, NameError) as exc:
        # A bug in the factory, said as such (it had been reported as failing at every size),
        # where it fails on the CPU too: on the meta device (check_model_fits) a factory that
        # reads its tensors' values fails alone, and the probes go on without it.
        if torch.empty(0).is_meta:
            try:
                with torch.device("cpu"):
                    factory(**arguments)
            except type(exc):
                pass
            else:
                raise exc
        given = ", ".join(f"{k}={v}" for k, v in arguments.items())
        raise PipelineError(f"--model {name}: {name.partition(':')[2]}({given}) raised "
                            f"{type(exc).__name__}: {exc}; fix the factory") from None
    if not isinstance(model, torch.nn.Module):
        raise PipelineError(f"--model {name}: the factory returned {type(model).__name__}, "
                            "not a torch.nn.Module")
    return model


def _adapt_input_channels(model, in_channels: int) -> None:
    """Swap the first convolution for one with ``in_channels`` inputs (grey digits: 1)."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            if module.in_channels == in_channels:
                return
            replacement = nn.Conv2d(in_channels, module.out_channels, module.kernel_size,
                                    module.stride, module.padding, module.dilation, 1,
                                    module.bias is not None, module.padding_mode)
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, replacement)
            return
    raise ValueError(f"{type(model).__name__} has no Conv2d whose input channels can be adapted")


def build_model(name: str, num_classes: int, in_channels: int, image_size: int = 32):
    """A freshly initialised model; the same arguments always build the same architecture."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name](num_classes=num_classes, in_channels=in_channels)
    if name.startswith("timm:"):
        return _timm().create_model(name[5:], pretrained=False, num_classes=num_classes,
                                    in_chans=in_channels)
    if USER_MODEL.match(name):
        return _call_factory(name, _user_factory(name), num_classes, in_channels, image_size)
    import torchvision

    if name not in torchvision_models():
        raise ValueError(f"unknown model {name!r}; known: {describe_known()}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # GoogLeNet's note on its old init
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes,
                                             **TORCHVISION_OPTIONS.get(name, {}))
    _adapt_input_channels(model, in_channels)
    _rescale_oversized_head(model, num_classes)
    zero_last_norm_of_residual_blocks(model)
    return model


def zero_last_norm_of_residual_blocks(model) -> None:
    """Zero the scale of the last BatchNorm in each inverted-residual block (torchvision's
    MobileNet V2 and V3, EfficientNet, MNASNet), so each block starts as the identity: Goyal et
    al. (2017) for ResNets, torchvision's `zero_init_residual`, timm's `zero_init_last`. From
    PyTorch's defaults these depthwise stacks learn too slowly for a range test to read: on
    photos10 in fp32, 450 steps from 1e-3 to 1 moved mobilenet_v2's smoothed loss from 2.33 to
    2.24 and efficientnet_b0's from 2.38 to 2.26, and three probes of 450 steps then took 37 to
    60% of --time 10m; zeroed, the same tests read 2.33 to 2.13 and 2.37 to 2.09 (`range_test`
    alone, Zen 4, 2026-12-06; the trainings in docs/measurements.md). ResNets keep torchvision's:
    zeroed, resnet18 scored 68.85% there against 68.80%, its first test no longer read and the
    second capped at 0.05."""
    from torch import nn

    for norm in _last_norms_of_residual_blocks(model):
        if not norm.weight.is_meta:  # shapes only (check_model_fits): no values
            nn.init.zeros_(norm.weight)


def _last_norms_of_residual_blocks(model) -> list:
    """The last BatchNorm of each block that adds its input back (`use_res_connect` in
    MobileNet V2/V3 and EfficientNet, `apply_residual` in MNASNet)."""
    from torch import nn

    blocks = [block for block in model.modules() if getattr(block, "use_res_connect", False)
              or getattr(block, "apply_residual", False)]
    norms = [[m for m in block.modules() if isinstance(m, nn.BatchNorm2d)] for block in blocks]
    return [found[-1] for found in norms if found]


def initialisation(name: str, num_classes: int, in_channels: int, image_size: int) -> str:
    """How build_model initialises the model, in words for the run's recipe (the blocks counted
    on a model built on the meta device: shapes only, no values)."""
    import torch

    if name in BUILTIN_MODELS or name.startswith("timm:") or USER_MODEL.match(name):
        return "the model's own"
    with torch.device("meta"):
        zeroed = len(_last_norms_of_residual_blocks(
            build_model(name, num_classes, in_channels, image_size)))
    return ("torchvision's" if not zeroed else
            f"torchvision's, the last BatchNorm of each of its {zeroed} residual "
            "blocks zeroed (each starts as the identity)")


def _rescale_oversized_head(model, num_classes: int) -> None:
    """Give the classifier (the last Linear layer with a logit per class) PyTorch's default
    initialisation where torchvision's is more than twice as spread: torchvision scales some
    heads by their outputs, for its 1,000 classes, and with 10 classes mnasnet0_5 (kaiming
    fan-out) and efficientnet_b0 (uniform +-1/sqrt(classes)) started at losses of 13.3 and 6.1
    on notMNIST. Not zeroed: a zero head passes no gradient to the layers below it, and
    efficientnet_b0's loss then fell too little in the range test for it to choose a learning
    rate (docs/measurements.md). Heads at the default scale (resnet18's) or below it
    (mobilenet's normal(0, 0.01)) keep their initialisation."""
    import math

    from torch import nn

    heads = [module for module in model.modules()
             if isinstance(module, nn.Linear) and module.out_features == num_classes]
    if not heads or heads[-1].weight.is_meta:  # shapes only (check_model_fits): no values
        return
    default_std = 1 / math.sqrt(3 * heads[-1].in_features)  # of uniform(+-1/sqrt(fan_in))
    if float(heads[-1].weight.detach().std()) > 2 * default_std:
        heads[-1].reset_parameters()


def model_spec(name: str, num_classes: int, in_channels: int, image_size: int) -> dict:
    """What rebuilds a model from its state_dict; stored with every checkpoint and artifact."""
    return {"model": name, "num_classes": num_classes, "in_channels": in_channels,
            "image_size": image_size}


def build_from_spec(spec: dict):
    return build_model(spec["model"], spec["num_classes"], spec["in_channels"],
                       spec.get("image_size", 32))


MATRIX_PRODUCTS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


def fully_connected_share(model, images) -> dict[str, float]:
    """What the fully connected layers are of a model, the part dynamic int8 quantizes:
    ``weights``, their share of its weights and kernels (every parameter of two or more
    dimensions), and ``work``, the share of the floating-point work of a call on ``images``
    that matrix products do (torch's flop counter: mm, addmm, bmm and baddbmm against all it
    counts, convolutions among them), so that attention's products count where they are not
    Linear modules."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    kernels = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(images)
    flops = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    products = sum(n for op, n in flops.items() if op in MATRIX_PRODUCTS)
    return {"weights": linear / kernels if kernels else 0.0,
            "work": products / sum(flops.values()) if flops else 0.0}


# ---------------------------------------------------------------- will it train at this size?

PROBE_SIZES = (8, 16, 32, 64, 75, 96, 128, 160, 224, 299)


def _meta_forward(name: str, num_classes: int, in_channels: int, image_size: int) -> dict:
    """Run the model's training forward pass on the meta device: shapes only, no memory, so a
    size that cannot work is found before any data is read. Returns the bytes of every leaf
    module's output per sample (what backward keeps) and the parameter count."""
    import torch

    # A module's top level runs once, at its first import: here on the CPU, not under meta.
    if name.startswith("timm:"):
        _timm()
    elif USER_MODEL.match(name):
        _user_factory(name)
    try:
        with torch.device("meta"):
            model = build_model(name, num_classes, in_channels, image_size)
    except (NotImplementedError, RuntimeError):  # an initialiser that copies real data
        model = build_model(name, num_classes, in_channels, image_size).to("meta")
    outputs = []

    def keep(module, inputs, output):
        if isinstance(output, torch.Tensor):
            outputs.append(output.numel())

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_hook(keep)
    model.train()
    batch = 2  # BatchNorm in training mode needs more than one value per channel
    out = model(torch.empty(batch, in_channels, image_size, image_size, device="meta"))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (batch, num_classes):
        raise ValueError(f"its training forward pass returns {type(out).__name__} "
                         f"{tuple(getattr(out, 'shape', ()))}, not logits of shape "
                         f"(batch, {num_classes})")
    return {"activation_bytes": 4 * sum(outputs) // batch,
            "parameters": sum(p.numel() for p in model.parameters())}


def _works(name: str, num_classes: int, in_channels: int, size: int, real=False) -> bool:
    """Whether the model's training forward pass takes a batch of this size: on the meta
    device, or with ``real`` on the CPU, for a forward that meta cannot run (one that reads
    its data: `if x.max() > 1`, `.item()`)."""
    import torch

    try:
        if not real:
            _meta_forward(name, num_classes, in_channels, size)
            return True
        with torch.no_grad():
            out = build_model(name, num_classes, in_channels, size).train()(
                torch.zeros(2, in_channels, size, size))
        return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, num_classes)
    except Exception:
        return False


def _available_memory(device) -> int | None:
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Sizes at which a model trains but a runtime of the chain cannot take it (each found by
# running the chain; tests/stages/models/test_families.py keeps them true).
CHAIN_MIN_SIZE = {"googlenet": (32, "OpenVINO cannot convert the ceil-mode 3x3 max-pool that "
                                    "meets a 2x2 map at smaller sizes")}


def check_model_fits(name: str, num_classes: int, in_channels: int, image_size: int,
                     batch_size: int, device, dataset_bytes: int = 0) -> None:
    """Refuse, before any data is read, a model that cannot train at this image size (its
    layers do not fit the size, or its memory does not fit the machine), saying what would."""
    if name in CHAIN_MIN_SIZE and image_size < CHAIN_MIN_SIZE[name][0]:
        smallest, reason = CHAIN_MIN_SIZE[name]
        raise UsageError(f"--model {name} at {image_size}x{image_size}: {reason}; use "
                         f"--image-size {smallest} or larger")
    try:
        probe = _meta_forward(name, num_classes, in_channels, image_size)
    except PipelineError:
        raise
    except (NotImplementedError,):  # an op without a meta kernel: nothing to say
        return
    except Exception as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        works = [s for s in PROBE_SIZES if _works(name, num_classes, in_channels, s)]
        if not works and _works(name, num_classes, in_channels, image_size, real=True):
            return  # a forward that reads its data, which meta cannot: nothing to say
        if not works:  # not a matter of size: the model's own error, or the data's channels
            raise UsageError(
                f"--model {name} fails on a batch of {in_channels}-channel {image_size}x"
                f"{image_size} images at every size from {PROBE_SIZES[0]} to "
                f"{PROBE_SIZES[-1]} ({type(exc).__name__}: {reason}); fix the model or choose "
                "another") from None
        raise UsageError(f"--model {name} cannot train on {image_size}x{image_size} images "
                         f"({reason}); it trains at --image-size "
                         f"{', '.join(map(str, works))}") from None
    available = _available_memory(device)
    if available is None:
        return
    # Activations kept for backward and their gradients, and the data set where it is held in
    # memory, grow with the image's area; weights, gradients, momentum and the autocast
    # copies do not.
    growing = batch_size * probe["activation_bytes"] * 2 + dataset_bytes
    fixed = probe["parameters"] * 4 * 4
    need = growing + fixed
    if need <= available:
        return
    largest = int(image_size * (max(available - fixed, 0) / growing) ** 0.5)
    fits = (f"the largest --image-size that fits at this batch size is about {largest}"
            if largest >= 8 else "lower --batch-size or choose a smaller model")
    raise UsageError(f"--image-size {image_size}: training {name} at --batch-size {batch_size} "
                     f"needs about {need / 2**30:.1f} GiB, and {available / 2**30:.1f} GiB are "
                     f"available on {device.type}; {fits}")

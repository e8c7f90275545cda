"""What `pipeline.load(...).predict` takes, checked once at the API's edge for every variant.

A runtime answers almost anything with logits: raw uint8 pixels, NaN, a 64x64 batch for a model
trained at 32x32 (PyTorch's pooling adapts). Those logits are wrong, and nothing downstream can
tell. So a batch is refused, with one line naming what was given and what is expected, unless it
has the dtype, rank, channels, size and values that the run's preprocessing (preprocessing.json)
gives. Images as paths or PIL images go through `Model.preprocess` and need none of this.
"""
from __future__ import annotations

import os

import numpy as np

# Preprocessing scales pixels into [0, 1] and normalises them, and bilinear resizing never leaves
# that range; a margin of half of it lets through what another resizer may overshoot (torch's
# bicubic on a float tensor: 0.41 of the range on a 2x2 dot), and still refuses raw 0-255 pixels
# by two orders of magnitude.
RANGE_MARGIN = 0.5
HOW = "model.preprocess(path_or_image) makes one image, or pass a list of paths"


def checked_batch(images, spec: dict) -> np.ndarray:
    """``images`` (N, C, H, W) or (C, H, W) as float32 numpy, or a one-line error."""
    array = _as_array(images)
    if array.dtype.kind in "biu":
        raise ValueError(f"predict got {array.dtype} values (raw pixels?); it takes preprocessed "
                         f"float images: {HOW}")
    if array.dtype.kind != "f":
        raise TypeError(f"predict got an array of {array.dtype}; it takes preprocessed float "
                        f"images: {HOW}")
    channels, size = spec["channels"], spec["image_size"]
    expected = f"(images, {channels}, {size}, {size}) or ({channels}, {size}, {size})"
    if array.ndim not in (3, 4) or array.shape[-3:] != (channels, size, size):
        raise ValueError(f"predict got an array of shape {tuple(array.shape)}; this model takes "
                         f"{expected}: {HOW}")
    bad = int(array.size - np.count_nonzero(np.isfinite(array)))
    if bad:
        raise ValueError(f"predict got {bad} NaN or infinite value(s) in an array of shape "
                         f"{tuple(array.shape)}; every value must be finite")
    _check_range(array, spec)
    return np.ascontiguousarray(array, dtype=np.float32)


def _as_array(images) -> np.ndarray:
    import torch
    from PIL import Image

    if isinstance(images, (str, bytes, os.PathLike, Image.Image)):
        shown = repr(os.fspath(images)) if not isinstance(images, Image.Image) else "image"
        raise TypeError(f"predict got one {type(images).__name__} ({shown}); it takes a list "
                        f"of paths or PIL images, or an array: wrap one in a list, "
                        f"predict([{shown}])")
    if isinstance(images, torch.Tensor):
        tensor = images.detach().cpu()
        return (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    if isinstance(images, np.ndarray):
        return images
    raise TypeError(f"predict got a {type(images).__name__}; it takes a list of paths or PIL "
                    "images, or a numpy array or torch tensor of preprocessed images")


def value_range(spec: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """Per channel, the lowest and highest value preprocessing can give; None where the run
    records no normalisation."""
    if "mean" not in spec or "std" not in spec:
        return None
    mean = np.asarray(spec["mean"], dtype=np.float64)
    std = np.asarray(spec["std"], dtype=np.float64)
    index = np.arange(spec["channels"]) % len(mean)  # grey data widened to 3 channels repeats
    return (0 - mean[index]) / std[index], (1 - mean[index]) / std[index]


def _check_range(array: np.ndarray, spec: dict) -> None:
    bounds = value_range(spec)
    if bounds is None or array.size == 0:
        return
    low, high = bounds
    margin = RANGE_MARGIN * (high - low)
    axes = (0, 2, 3) if array.ndim == 4 else (1, 2)
    seen_low = array.min(axis=axes).astype(np.float64)
    seen_high = array.max(axis=axes).astype(np.float64)
    if np.any(seen_low < low - margin) or np.any(seen_high > high + margin):
        raise ValueError(
            f"predict got values from {seen_low.min():.4g} to {seen_high.max():.4g}, outside "
            f"what this run's preprocessing gives ({low.min():.4g} to {high.max():.4g}: pixels "
            f"scaled to [0, 1], normalised with mean {spec['mean']} and std {spec['std']}); raw "
            f"pixels? {HOW}")

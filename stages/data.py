"""Data sets as in-memory tensors, seeded stratified splits, loaders and calibration subsets.

The default data set, scikit-learn's handwritten digits, ships inside an installed package, so
the whole chain runs with no download. Calibration and validation always come from the training
split; the test split is only ever used to measure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stages.registry import lookup, register

DATASETS: dict[str, Callable[..., "DataSplits"]] = {}


def register_dataset(name: str):
    return register(DATASETS, name)


@dataclass
class DataSplits:
    """Train (fits weights), val (picks the best epoch, scores quantization choices), test."""

    train: "torch.utils.data.TensorDataset"
    val: "torch.utils.data.TensorDataset"
    test: "torch.utils.data.TensorDataset"
    num_classes: int
    in_channels: int
    image_size: int

    def input_shape(self, batch_size: int) -> tuple[int, int, int, int]:
        return (batch_size, self.in_channels, self.image_size, self.image_size)


def _stratified_split(labels, fraction: float, seed: int):
    """Indices (kept, held_out) with ``fraction`` of every class held out, fixed by ``seed``."""
    from sklearn.model_selection import train_test_split
    import numpy as np

    indices = np.arange(len(labels))
    return train_test_split(indices, test_size=fraction, random_state=seed, stratify=labels)


@register_dataset("digits")
def digits(image_size: int = 32, seed: int = 0, test_fraction: float = 0.2,
           val_fraction: float = 0.1, **_: object) -> DataSplits:
    """scikit-learn's 1,797 8x8 grey digits, scaled to [0, 1], normalised, resized to image_size.

    The test split depends only on a fixed seed (0), never on --seed, so that every run of every
    seed is scored on the same images; --seed moves the train/val split and training only.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    rest, test = _stratified_split(bunch.target, test_fraction, seed=0)
    train, val = _stratified_split(bunch.target[rest], val_fraction, seed=seed)
    train, val = rest[train], rest[val]

    # Statistics of train+val, never test, and independent of --seed so test inputs are fixed.
    mean, std = images[rest].mean(), images[rest].std()
    images = (images - mean) / std
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                               align_corners=False)

    def subset(idx: np.ndarray) -> torch.utils.data.TensorDataset:
        idx = torch.as_tensor(np.sort(idx))
        return torch.utils.data.TensorDataset(images[idx].contiguous(), labels[idx])

    return DataSplits(subset(train), subset(val), subset(test), num_classes=10, in_channels=1,
                      image_size=image_size)


def load_dataset(name: str, image_size: int, seed: int, **options: object) -> DataSplits:
    return lookup(DATASETS, name, "dataset")(image_size=image_size, seed=seed, **options)


def make_loader(dataset, batch_size: int, shuffle: bool, seed: int = 0):
    """A DataLoader whose shuffling depends only on ``seed``, so fp32 and amp see one order."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                                       generator=generator, drop_last=False)


def calibration_batches(splits: DataSplits, num_samples: int, batch_size: int, seed: int):
    """Tensors of training images (never test images) for static quantization to observe."""
    import torch

    if num_samples < 1:
        raise ValueError(f"--calibration-samples must be at least 1, got {num_samples}")
    images = splits.train.tensors[0]
    if len(images) == 0:
        raise ValueError("the training split is empty; static quantization needs calibration data")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    chosen = images[order[:num_samples]]
    return list(torch.split(chosen, batch_size))

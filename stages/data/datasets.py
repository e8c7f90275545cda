"""Data sets by name, their seeded stratified splits, and the data a run was trained on.

The default data set, UCI's handwritten digits (stages/data/digits.npz, 45 kB), ships inside
this package, so the whole chain runs with no download and no extra dependency. The others are
read by torchvision from --data-dir (stages/data/torchvision_sets.py). Loaders are in
stages/data/loaders.py, the calibration and selection images in stages/data/subsets.py.
Calibration and validation always come from the training split; the test split is only ever
used to measure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from stages.run.errors import PipelineError
from stages.run.registry import lookup, register
from stages.run.trained import float_source, trained_data

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

DATASETS: dict[str, Callable[..., "DataSplits"]] = {}


def register_dataset(name: str):
    return register(DATASETS, name)


@dataclass
class DataSplits:
    """train (fits weights, augmented), val (picks the best epoch), test (only measures), and
    calibration: the training images without augmentation, for static quantization."""

    train: "torch.utils.data.Dataset"
    val: "torch.utils.data.Dataset"
    test: "torch.utils.data.Dataset"
    calibration: "torch.utils.data.Dataset"
    num_classes: int
    in_channels: int
    image_size: int
    skipped_images: int = 0
    # Those files, relative to --data-dir: a later stage (and each child process it starts)
    # drops them again without decoding every file of the folder to find them.
    skipped_files: tuple[str, ...] = ()
    data_dir: str | None = None  # the folder read, absolute (None: data shipped with us)
    test_fraction: float | None = None  # the test share one image folder was split with
    classes: tuple[str, ...] = ()  # the name of each class index, as the data set gives them
    # How one image becomes the model's input (stages/data/preprocess.py): the evaluation
    # transform as numbers, for pipeline.load, predict and export.
    preprocessing: dict | None = None
    augmentation: str = "none"  # what training images go through, in words (the run's recipe)

    def input_shape(self, batch_size: int) -> tuple[int, int, int, int]:
        return (batch_size, self.in_channels, self.image_size, self.image_size)

    def identity(self) -> dict:
        """Per split, how many images and a sha256 of which: an image folder's files by their
        path in it, other sets' images by index; and the files skipped as unreadable. Recorded
        with the float model (data=)."""
        import hashlib

        def members(split) -> list[str]:
            base, indices = ((split.dataset, split.indices) if hasattr(split, "indices")
                             else (split, range(len(split))))
            samples = getattr(base, "samples", None)
            if samples is None:
                return [str(i) for i in indices]
            return [Path(samples[i][0]).relative_to(base.root).as_posix() for i in indices]

        identity = {}
        for name in ("train", "val", "test"):
            found = members(getattr(self, name))
            identity[name] = {"images": len(found), "sha256": hashlib.sha256(  # a name that is
                "\n".join(found).encode(errors="surrogateescape")).hexdigest()}  # not UTF-8 too
        where = {"data_dir": self.data_dir, "test_fraction": self.test_fraction}
        return identity | {"skipped_files": list(self.skipped_files)} | {
            key: value for key, value in where.items() if value is not None}


# The test split's share where a data set has none of its own (the digits, one image folder):
# fixed, and drawn with a fixed seed, so runs that differ in --seed or --val-fraction are scored
# on the same images.
TEST_FRACTION = 0.2


def stratified_split(labels, fraction: float, seed: int):
    """Indices (kept, held_out), sorted, with ``fraction`` of every class held out at random
    (fixed by ``seed``): ceil(fraction x all) in total, shared among the classes in proportion
    to their sizes (largest remainders first), and at least one image of each class on each
    side."""
    import numpy as np

    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    if (counts < 2).any():
        lonely = classes[counts < 2][0]
        raise PipelineError(f"cannot hold out {fraction:g} of every class: class {lonely} has a "
                            "single image; give every class two or more")
    total = math.ceil(fraction * len(labels))
    share = counts * total / len(labels)
    held = np.floor(share).astype(int)
    by_remainder = np.argsort(-(share - held), kind="stable")
    held[by_remainder[:total - held.sum()]] += 1
    held = np.clip(held, 1, counts - 1)
    rng = np.random.default_rng(seed)
    kept, held_out = [], []
    for label, count in zip(classes, held):
        members = rng.permutation(np.flatnonzero(labels == label))
        held_out.append(members[:count])
        kept.append(members[count:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held_out))


def three_splits(labels, test_fraction: float, val_fraction: float, seed: int):
    """Indices (train, val, test) of ``labels``, each class in proportion: the test split with
    a fixed seed (0), the same whatever --seed; validation from the rest with ``seed``."""
    import numpy as np

    labels = np.asarray(labels)
    rest, test = stratified_split(labels, test_fraction, seed=0)
    train, val = stratified_split(labels[rest], val_fraction, seed=seed)
    return rest[train], rest[val], test


def digits_arrays():
    """The digits as shipped: images (1797, 8, 8) of 0..16 and labels (1797,), uint8."""
    import numpy as np

    with np.load(Path(__file__).with_name("digits.npz"), allow_pickle=False) as data:
        return data["images"], data["labels"]


@register_dataset("digits")
def digits(image_size: int = 32, seed: int = 0, val_fraction: float = 0.1,
           in_channels: int | None = None, **_: object) -> DataSplits:
    """The 1,797 8x8 grey digits of UCI's Optical Recognition of Handwritten Digits (test set;
    E. Alpaydin and C. Kaynak, 1998; CC BY 4.0), shipped in stages/data/digits.npz (the copy
    scikit-learn ships as load_digits, pixels 0..16), scaled to [0, 1], normalised, resized to
    image_size.

    The test split (20%) depends only on a fixed seed (0), never on --seed, so every run of every
    seed is scored on the same images; --seed moves the train/val split and training only.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F

    raw_images, raw_labels = digits_arrays()
    images = torch.tensor(raw_images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw_labels, dtype=torch.long)
    train, val, test = three_splits(raw_labels, TEST_FRACTION, val_fraction, seed)
    rest = np.sort(np.concatenate([train, val]))

    # Statistics of train+val, never test, and independent of --seed so test inputs are fixed.
    mean, std = images[rest].mean(), images[rest].std()
    images = (images - mean) / std
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                               align_corners=False)
    if in_channels and in_channels != 1:
        images = images.expand(-1, in_channels, -1, -1)

    def subset(idx: np.ndarray) -> torch.utils.data.TensorDataset:
        idx = torch.as_tensor(np.sort(idx))
        return torch.utils.data.TensorDataset(images[idx].contiguous(), labels[idx])

    train_set = subset(train)
    # A digit from a file is reduced to the data set's 8x8, scaled to [0, 1] (the data set's
    # 0..16 over 16), normalised with these statistics, then resized like the data set.
    preprocessing = {"colour": "L", "source_size": 8, "resize": "bilinear-half-pixel",
                     "mean": [float(mean)], "std": [float(std)]}
    return DataSplits(train_set, subset(val), subset(test), train_set, num_classes=10,
                      in_channels=images.shape[1], image_size=image_size,
                      classes=tuple(str(i) for i in range(10)), preprocessing=preprocessing)


# Classes and channels of each data set, known before it is read (an image folder's classes
# are counted when it is read); and how many images it holds in memory at the model's size.
SHAPES = {"digits": (10, 1), "mnist": (10, 1), "fashion-mnist": (10, 1), "cifar10": (10, 3),
          "cifar100": (100, 3), "imagefolder": (10, 3)}
IN_MEMORY_IMAGES = {"digits": 1797}
TORCHVISION_SETS = ("mnist", "fashion-mnist", "cifar10", "cifar100")  # read from --data-dir


# The names an image folder's split subfolders go by (Kaggle's and Roboflow's "valid" too).
SPLIT_NAMES = {"train": ("train", "training"), "val": ("val", "valid", "validation"),
               "test": ("test", "testing")}


def visible_folders(path: Path) -> list[Path]:
    """Subfolders but hidden ones (.ipynb_checkpoints, .git), as predict lists a folder."""
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def split_folders(root: Path) -> dict[str, Path]:
    """An image folder's train, val and test subfolders by split, where it has a training
    folder of class folders beside a val or test folder; else {} (its subfolders are the
    classes: a class may be called train). Read as classes, train/ and valid/ had trained a
    two-class model of which folder an image came from."""
    by_name = {p.name.lower(): p for p in visible_folders(root)}
    found = {}
    for split, names in SPLIT_NAMES.items():
        present = [by_name[name] for name in names if name in by_name]
        found |= {split: present} if present else {}
    if "train" not in found or len(found) == 1:
        return {}
    if not visible_folders(found["train"][0]):
        if len(by_name) == sum(len(paths) for paths in found.values()):  # split folders alone
            raise PipelineError(f"--dataset imagefolder: {found['train'][0]} holds no class "
                                "subfolders; put each class's images in a subfolder of its own "
                                "in every split folder (train/cat/1.jpg, test/cat/2.jpg)")
        return {}  # classes, one of them called train
    twice = next((paths for paths in found.values() if len(paths) > 1), None)
    if twice:
        raise PipelineError(f"--dataset imagefolder: {root} has both {twice[0].name}/ and "
                            f"{twice[1].name}/ as split folders; keep one")
    return {split: paths[0] for split, paths in found.items()}


def expected_shape(config) -> tuple[int, int, int]:
    """(classes, channels, bytes held in memory) a training config's data will have; an image
    folder's classes are its class subfolders (of its training folder where it has one)."""
    classes, channels = SHAPES[config.dataset]
    if config.dataset == "imagefolder":
        root = Path(config.data_dir).expanduser()
        if not root.is_dir():  # before a model of a guessed ten classes meets the weights
            raise PipelineError(f"--dataset imagefolder: {root} is not a folder; point "
                                "--data-dir at a folder of class subfolders (or with train/ "
                                "and val/ inside)")
        root = split_folders(root).get("train", root)
        classes = len(visible_folders(root))
        if not classes:  # refused before a run exists for it, not after
            raise PipelineError(f"--dataset imagefolder: {root} has no class subfolders; put "
                                "each class's images in a subfolder of its own")
    elif config.dataset in TORCHVISION_SETS:
        from stages.data.torchvision_sets import check_present

        check_present(config.dataset, config.data_dir, config.download)
    channels = config.in_channels or channels
    held = IN_MEMORY_IMAGES.get(config.dataset, 0) * channels * config.image_size ** 2 * 4
    return classes, channels, held


def load_dataset(name: str, image_size: int, seed: int, **options: object) -> DataSplits:
    return lookup(DATASETS, name, "dataset")(image_size=image_size, seed=seed, **options)


def load_splits(config, trained_on: dict | None = None) -> DataSplits:
    """The splits a config names: a TrainConfig, an ImportConfig, or the DataConfig a run's
    trained model saved (stages/run/trained.py); refused where ``trained_on``, the identity
    recorded when the run trained (DataSplits.identity), differs: split again, a folder with a
    file more or less moves images between the test and training splits. The data is read
    where the run found it (``trained_on``'s absolute data_dir) while that folder is there,
    else from the config's data_dir (a run copied elsewhere with its data)."""
    recorded = trained_on or {}
    skipped = recorded.get("skipped_files")  # None: a run from before it was kept
    found_at = recorded.get("data_dir")
    data_dir = found_at if found_at and Path(found_at).is_dir() else config.data_dir
    # A run from before the test share was recorded: one image folder's was --val-fraction's.
    test_fraction = TEST_FRACTION if trained_on is None else recorded.get("test_fraction")
    try:
        splits = load_dataset(config.dataset, image_size=config.image_size, seed=config.seed,
                              data_dir=data_dir, download=config.download,
                              val_fraction=config.val_fraction, in_channels=config.in_channels,
                              skip_bad_images=config.skip_bad_images, test_fraction=test_fraction,
                              known_unreadable=None if skipped is None else frozenset(skipped))
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    now = splits.identity() if trained_on is not None else {}
    changed = next((s for s in ("test", "val", "train") if now and now[s] != trained_on[s]), None)
    if changed:
        before, after = trained_on[changed]["images"], now[changed]["images"]
        raise PipelineError(
            f"the data in {data_dir} is not what this run was trained on: its {changed} "
            f"split held {before} images and now holds "
            f"{after if after != before else 'as many, but others'}, so test images could be "
            "training images; put the data back as it was, or train a new run on it")
    return splits


def preprocessing_spec(splits: DataSplits, dataset: str) -> dict:
    """What stages/data/preprocess.py needs to turn an image file into this model's input,
    and the class names: preprocessing.json."""
    return {"dataset": dataset, "image_size": splits.image_size,
            "channels": splits.in_channels, "classes": list(splits.classes),
            **(splits.preprocessing or {})}


def record_preprocessing(run, splits: DataSplits, dataset: str, stage: str) -> None:
    """Write preprocessing.json into the run and list it, for load, predict and export."""
    from stages.run.files import atomic_write_json

    path = run.root / "preprocessing.json"
    atomic_write_json(path, preprocessing_spec(splits, dataset))
    run.register("preprocessing", path, kind="data", stage=stage)


def preprocessing_of_run(run) -> dict:
    """The run's preprocessing.json, or (a run made before it was written) the same rebuilt
    from the data set it was trained on."""
    import json

    if "preprocessing" in run.artifacts():
        return json.loads(run.verified_path("preprocessing").read_text())
    return preprocessing_spec(splits_of_run(run), trained_data(run).dataset)


def splits_of_run(run) -> DataSplits:
    """The data a run was trained on, rebuilt from the training config in its manifest, and
    refused where it changed since (runs before 2026-12-07 recorded no identity)."""
    return load_splits(trained_data(run), run.entry(float_source(run)).get("data"))


# The torchvision data sets and image folders register themselves on import.
from stages.data import torchvision_sets  # noqa: E402,F401  isort: skip

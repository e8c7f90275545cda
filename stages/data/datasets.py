"""Data sets, seeded stratified splits, loaders that resume mid-epoch, calibration subsets.

The default data set, UCI's handwritten digits (stages/data/digits.npz, 45 kB), ships inside
this package, so the whole chain runs with no download and no extra dependency. The others are
read by torchvision from --data-dir.
Calibration and validation always come from the training split; the test split is only ever
used to measure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from stages.run.errors import PipelineError
from stages.run.registry import lookup, register

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

DATASETS: dict[str, Callable[..., "DataSplits"]] = {}
# Per-channel mean and std of each training set, as published with it.
STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}


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
    classes: tuple[str, ...] = ()  # the name of each class index, as the data set gives them
    # How one image becomes the model's input (stages/data/preprocess.py): the evaluation
    # transform as numbers, for pipeline.load, predict and export.
    preprocessing: dict | None = None

    def input_shape(self, batch_size: int) -> tuple[int, int, int, int]:
        return (batch_size, self.in_channels, self.image_size, self.image_size)


def _stratified_split(labels, fraction: float, seed: int):
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
    rest, test = _stratified_split(raw_labels, 0.2, seed=0)
    train, val = _stratified_split(raw_labels[rest], val_fraction, seed=seed)
    train, val = rest[train], rest[val]

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


# ---------------------------------------------------------------- torchvision data sets


class _Widen:
    """Repeat a grey channel to the number of channels the model wants (a picklable transform,
    so DataLoader workers can use it)."""

    def __init__(self, channels: int) -> None:
        self.channels = channels

    def __call__(self, image):
        return image.expand(self.channels, -1, -1) if image.shape[0] == 1 else image


NATIVE_SIZE = {"mnist": 28, "fashion-mnist": 28, "cifar10": 32, "cifar100": 32}


def _transforms(name: str, image_size: int, in_channels: int | None, train: bool):
    """Resize (where the native size differs), light augmentation for training only, normalise,
    and widen grey to the channels the model wants. ImageFolder already converts to RGB."""
    from torchvision import transforms as T

    mean, std = STATS[name]
    steps = []
    if NATIVE_SIZE.get(name) != image_size:
        steps.append(T.Resize((image_size, image_size)))
    if train:
        # Shifts for everything, mirror images only where they stay valid (a mirrored digit is
        # not the same digit).
        steps.append(T.RandomCrop(image_size, padding=max(1, image_size // 8)))
        if not name.endswith("mnist"):
            steps.append(T.RandomHorizontalFlip())
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    if in_channels and in_channels > len(mean):
        steps.append(_Widen(in_channels))
    return T.Compose(steps)


def _pil_preprocessing(name: str) -> dict:
    """_transforms(train=False) as numbers: torchvision's Resize on a PIL image is PIL's own
    bilinear resize, then ToTensor (divide by 255) and Normalize."""
    mean, std = STATS[name]
    return {"colour": "L" if len(mean) == 1 else "RGB", "source_size": None,
            "resize": "pil-bilinear", "mean": list(mean), "std": list(std)}


def _expected_files(name: str, root: Path) -> tuple[Path, list[str]]:
    from torchvision import datasets

    if name in ("mnist", "fashion-mnist"):
        cls = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
        return root / cls.__name__ / "raw", [Path(url).stem for url, _ in cls.resources]
    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    files = [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return root / cls.base_folder, files


def _torchvision_splits(name: str, image_size: int, seed: int, data_dir: Path, download: bool,
                        val_fraction: float, in_channels: int | None) -> DataSplits:
    import torch
    from torchvision import datasets

    cls = {"mnist": datasets.MNIST, "fashion-mnist": datasets.FashionMNIST,
           "cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}[name]
    root = Path(data_dir).expanduser()

    def load(train: bool, augment: bool):
        transform = _transforms(name, image_size, in_channels, augment)
        try:
            return cls(str(root), train=train, download=download, transform=transform)
        except RuntimeError as exc:
            folder, files = _expected_files(name, root)
            hint = "" if download else "; pass --download to fetch it where the network allows"
            raise PipelineError(f"--dataset {name}: no usable data in {folder} (expected "
                                f"{', '.join(files)}){hint}") from exc
        except OSError as exc:
            raise PipelineError(f"--dataset {name}: cannot read {root}: {exc}") from exc

    augmented, plain, test = load(True, True), load(True, False), load(False, False)
    labels = torch.as_tensor(augmented.targets).numpy()
    train_idx, val_idx = _stratified_split(labels, val_fraction, seed)
    subset = torch.utils.data.Subset
    channels = in_channels or len(STATS[name][0])
    return DataSplits(subset(augmented, sorted(train_idx)), subset(plain, sorted(val_idx)), test,
                      subset(plain, sorted(train_idx)), num_classes=len(augmented.classes),
                      in_channels=channels, image_size=image_size,
                      classes=tuple(augmented.classes), preprocessing=_pil_preprocessing(name))


for _name in ("mnist", "fashion-mnist", "cifar10", "cifar100"):
    register_dataset(_name)(
        lambda name=_name, image_size=32, seed=0, data_dir="data", download=False,
        val_fraction=0.1, in_channels=None, **_: _torchvision_splits(
            name, image_size, seed, data_dir, download, val_fraction, in_channels))


def _unreadable_images(paths: list[str]) -> list[str]:
    """Files PIL cannot decode completely: zero bytes, truncated, or not an image at all."""
    from PIL import Image

    bad = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
        except Exception:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError)
            bad.append(path)
    return bad


def _drop_images(folder_dataset, bad: set[str]) -> None:
    kept = [(p, t) for p, t in folder_dataset.samples if p not in bad]
    folder_dataset.samples = folder_dataset.imgs = kept
    folder_dataset.targets = [t for _, t in kept]


@register_dataset("imagefolder")
def imagefolder(image_size: int = 32, seed: int = 0, data_dir: str = "data",
                val_fraction: float = 0.1, in_channels: int | None = None,
                skip_bad_images: bool = False, **_: object) -> DataSplits:
    """A folder of class subfolders: train/ and val/ (or test/) when present, otherwise one
    folder split into train, val and test, each class in proportion."""
    import torch
    from torchvision import datasets

    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise PipelineError(f"--dataset imagefolder: {root} is not a folder; point --data-dir at "
                            "a folder of class subfolders (or with train/ and val/ inside)")

    skipped, scanned = 0, {}

    def folder(path: Path, augment: bool, count: bool):
        """ImageFolder of ``path``; ``count``: add its skipped files to the total (each file is
        read by two datasets, with and without augmentation, but counted once)."""
        nonlocal skipped
        try:
            found = datasets.ImageFolder(str(path), transform=_transforms(
                "imagefolder", image_size, in_channels, augment))
        except (FileNotFoundError, RuntimeError) as exc:
            raise PipelineError(f"--dataset imagefolder: {path}: {exc}; each class needs a "
                                "subfolder of images") from None
        if path not in scanned:  # each folder is opened twice; decode its files once
            scanned[path] = _unreadable_images([p for p, _ in found.samples])
        bad = scanned[path]
        if bad and not skip_bad_images:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise PipelineError(f"--dataset imagefolder: {len(bad)} unreadable image(s): {shown}; "
                                "remove them or pass --skip-bad-images")
        if bad:
            _drop_images(found, set(bad))
            skipped += len(bad) if count else 0
        return found

    held_out = next((root / n for n in ("val", "test") if (root / n).is_dir()), None)
    subset = torch.utils.data.Subset
    if (root / "train").is_dir() and held_out is not None:
        augmented, plain = folder(root / "train", True, True), folder(root / "train", False, False)
        test = folder(held_out, False, True)
        if test.classes != augmented.classes:
            raise PipelineError(f"--dataset imagefolder: {root / 'train'} and {held_out} have "
                                "different class subfolders")
        train_idx, val_idx = _stratified_split(augmented.targets, val_fraction, seed)
    else:
        augmented, plain = folder(root, True, True), folder(root, False, False)
        rest, test_idx = _stratified_split(augmented.targets, val_fraction, seed=0)
        rest_targets = [augmented.targets[i] for i in rest]
        train_part, val_part = _stratified_split(rest_targets, val_fraction, seed)
        train_idx, val_idx = rest[train_part], rest[val_part]
        test = subset(plain, sorted(test_idx))
    return DataSplits(subset(augmented, sorted(train_idx)), subset(plain, sorted(val_idx)), test,
                      subset(plain, sorted(train_idx)), num_classes=len(augmented.classes),
                      in_channels=in_channels or 3, image_size=image_size,
                      skipped_images=skipped, classes=tuple(augmented.classes),
                      preprocessing=_pil_preprocessing("imagefolder"))


# Classes and channels of each data set, known before it is read (an image folder's classes
# are counted when it is read); and how many images it holds in memory at the model's size.
SHAPES = {"digits": (10, 1), "mnist": (10, 1), "fashion-mnist": (10, 1), "cifar10": (10, 3),
          "cifar100": (100, 3), "imagefolder": (10, 3)}
IN_MEMORY_IMAGES = {"digits": 1797}


def expected_shape(config) -> tuple[int, int, int]:
    """(classes, channels, bytes held in memory) a training config's data will have; an image
    folder's classes are its class subfolders (of train/ where it has one)."""
    classes, channels = SHAPES[config.dataset]
    if config.dataset == "imagefolder":
        root = Path(getattr(config, "data_dir", "data")).expanduser()
        root = root / "train" if (root / "train").is_dir() else root
        if root.is_dir():
            classes = sum(1 for p in root.iterdir() if p.is_dir()) or classes
    channels = getattr(config, "in_channels", None) or channels
    held = IN_MEMORY_IMAGES.get(config.dataset, 0) * channels * config.image_size ** 2 * 4
    return classes, channels, held


def load_dataset(name: str, image_size: int, seed: int, **options: object) -> DataSplits:
    return lookup(DATASETS, name, "dataset")(image_size=image_size, seed=seed, **options)


def load_splits(config) -> DataSplits:
    """The splits a training config names (a saved config from an older run may lack keys)."""
    option = lambda name, default: getattr(config, name, default)  # noqa: E731
    try:
        return load_dataset(config.dataset, image_size=config.image_size, seed=config.seed,
                            data_dir=option("data_dir", "data"), download=option("download", False),
                            val_fraction=option("val_fraction", 0.1),
                            in_channels=option("in_channels", None),
                            skip_bad_images=option("skip_bad_images", False))
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def preprocessing_spec(splits: DataSplits, dataset: str) -> dict:
    """What stages/data/preprocess.py needs to turn an image file into this model's input,
    and the class names: preprocessing.json."""
    return {"dataset": dataset, "image_size": splits.image_size,
            "channels": splits.in_channels, "classes": list(splits.classes),
            **(splits.preprocessing or {})}


def record_preprocessing(run, splits: DataSplits, dataset: str, stage: str) -> None:
    """Write preprocessing.json into the run and list it, for load, predict and export."""
    from stages.run.artifacts import atomic_write_json

    path = run.root / "preprocessing.json"
    atomic_write_json(path, preprocessing_spec(splits, dataset))
    run.register("preprocessing", path, kind="data", stage=stage)


def preprocessing_of_run(run) -> dict:
    """The run's preprocessing.json, or (a run made before it was written) the same rebuilt
    from the data set it was trained on."""
    import json

    if "preprocessing" in run.artifacts():
        return json.loads(run.verified_path("preprocessing").read_text())
    trained = next(run.artifacts()[n] for n in ("amp", "fp32") if n in run.artifacts())
    return preprocessing_spec(splits_of_run(run), trained["config"].get("dataset", "digits"))


def splits_of_run(run) -> DataSplits:
    """The data a run was trained on, rebuilt from the training config in its manifest."""
    from types import SimpleNamespace

    artifacts = run.artifacts()
    trained = next((artifacts[n] for n in ("amp", "fp32") if n in artifacts), None)
    if trained is None:
        raise PipelineError(f"run {run.name!r} has no trained model; run 'pipeline train' first")
    return load_splits(SimpleNamespace(**trained["config"]))


# ---------------------------------------------------------------- loading


class EpochSampler:
    """Shuffled indices that depend only on (seed, epoch): the same order for fp32 and amp, on
    every rank's share, and after a resume, which starts ``start`` samples into the epoch."""

    def __init__(self, size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        import torch

        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        # Pad so that every rank gets as many samples (DistributedSampler does the same).
        per_rank = -(-self.size // self.world_size)
        order += order[: per_rank * self.world_size - self.size]
        return order[self.rank::self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return len(self._indices()) - self.start


def make_loader(dataset, batch_size: int, sampler=None, workers: int = 0, pin_memory: bool = False,
                timeout: float = 0):
    import torch

    # A generator of its own keeps the loader from drawing worker seeds from the global RNG,
    # whose state a checkpoint restores: a resumed run then draws exactly what the original did.
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                       shuffle=False, num_workers=workers, pin_memory=pin_memory,
                                       timeout=timeout, generator=torch.Generator().manual_seed(0))


def batches(dataset, batch_size: int = 256):
    """(images, labels) of a data set in order, without augmentation randomness of our own."""
    yield from make_loader(dataset, batch_size)


def first_images(dataset, count: int):
    import torch

    count = min(count, len(dataset))
    return torch.stack([dataset[i][0] for i in range(count)]) if count else torch.empty(0)


def calibration_batches(splits: DataSplits, num_samples: int, batch_size: int, seed: int):
    """Tensors of training images (never test images) for static quantization to observe."""
    import torch

    if num_samples < 1:
        raise ValueError(f"--calibration-samples must be at least 1, got {num_samples}")
    if len(splits.calibration) == 0:
        raise ValueError("the training split is empty; static quantization needs calibration data")
    chosen = torch.utils.data.Subset(splits.calibration,
                                     _calibration_order(splits, seed)[:num_samples])
    return [images for images, _ in make_loader(chosen, batch_size)]


def _calibration_order(splits: DataSplits, seed: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(len(splits.calibration), generator=generator).tolist()


# Quantization damage is measured as flips between two models on the same images: on a model
# where 4-5% of predictions flip (efficientnet_b0 on notMNIST), the change in accuracy on 1,024
# images has a standard error near 0.65 points, and a search that stops at the first candidate
# within the budget keeps the one whose noise flattered it (-0.39 held-out, -2.05 on test).
# 4,096 images halve that, and the budget holds the drop at 95% confidence, so that what noise
# is left does not choose (stats.worst_change); a data set with fewer held-out images uses what
# it has, and its wider bound says so.
SELECTION_IMAGES = 4096


# What a variant's held-out accuracy was measured on, in report.json's words.
SELECTION_WORDS = "validation split and held-out training images"
VALIDATION_WORDS = "the half of the validation split qat did not choose its epoch on"
BASELINE_WORDS = "validation split"  # a model trained apart from the reference, as it was


def validation_halves(size: int) -> tuple[list[int], list[int]]:
    """Indices into the validation split: (the half qat chooses its epoch on, the half the
    report judges fine-tuned variants on). Every other image, so that both halves keep the
    split's class mix; choosing and judging on the same images would favour the epoch that fit
    their noise (a winner's curse: on 144 images, 91.0% chosen, 4 points less on test)."""
    return list(range(0, size, 2)), list(range(1, size, 2))


def selection_set(splits: DataSplits, calibration_samples: int, seed: int,
                  limit: int = SELECTION_IMAGES):
    """The images every choice is made on (--auto, the recommendation): the validation split
    plus training images that calibration did not see, at most ``limit``. Never test images.
    Quantization damage is a difference between two models on the same images, so training
    images serve, and make the set large enough that one flipped image does not decide.
    Only the chosen images are ever decoded (a large training split is not read whole)."""
    import torch

    from_val = min(len(splits.val), limit)
    unseen = _calibration_order(splits, seed)[calibration_samples:][:limit - from_val]
    parts = [torch.utils.data.Subset(splits.val, range(from_val)),
             torch.utils.data.Subset(splits.calibration, unseen)]
    return torch.utils.data.ConcatDataset(parts)


def tuning_images(splits: DataSplits, calibration_samples: int, seed: int,
                  limit: int = SELECTION_IMAGES):
    """(images, labels) of ``selection_set`` as two tensors."""
    import torch

    images, labels = zip(*batches(selection_set(splits, calibration_samples, seed, limit)))
    return torch.cat(images), torch.cat(labels)


def check_calibration(batches: list, shape: tuple[int, int, int]) -> None:
    """Refuse calibration data that would quantize a model wrongly, before any work starts."""
    import torch

    if not batches or sum(len(b) for b in batches) == 0:
        raise PipelineError("calibration data is empty; static quantization needs training "
                            "images (raise --calibration-samples)")
    for i, batch in enumerate(batches):
        if not isinstance(batch, torch.Tensor) or batch.dtype != torch.float32:
            kind = getattr(batch, "dtype", type(batch).__name__)
            raise PipelineError(f"calibration batch {i} is {kind}; expected float32 images")
        if batch.dim() != 4 or tuple(batch.shape[1:]) != tuple(shape):
            raise PipelineError(f"calibration batch {i} has shape {tuple(batch.shape)}; expected "
                                f"(N, {', '.join(map(str, shape))}) like the model's input")
        if not torch.isfinite(batch).all():
            raise PipelineError(f"calibration batch {i} holds NaN or infinite values")

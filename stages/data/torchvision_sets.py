"""The data sets torchvision reads from --data-dir: MNIST, Fashion-MNIST, CIFAR-10/100, and a
folder of class subfolders (ImageFolder), with their transforms and preprocessing record."""
from __future__ import annotations

from pathlib import Path

from stages.data.datasets import (
    TEST_FRACTION,
    TORCHVISION_SETS,
    DataSplits,
    register_dataset,
    split_folders,
    stratified_split,
    three_splits,
)
from stages.run.errors import PipelineError

# Per-channel mean and std of each training set, as published with it.
STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}


class _Widen:
    """Repeat a grey channel to the number of channels the model wants (a picklable transform,
    so DataLoader workers can use it)."""

    def __init__(self, channels: int) -> None:
        self.channels = channels

    def __call__(self, image):
        return image.expand(self.channels, -1, -1) if image.shape[0] == 1 else image


# Sizes the files come in; an image folder's loader resizes each image itself (_DecodedImages).
NATIVE_SIZE = {"mnist": 28, "fashion-mnist": 28, "cifar10": 32, "cifar100": 32}


def _shift(image_size: int) -> int:
    return max(1, image_size // 8)


def _mirrors(name: str) -> bool:
    """Shifts for everything, mirror images only where they stay valid (a mirrored digit or
    letter is not the same one)."""
    return not name.endswith("mnist")


def augmentation_of(name: str, image_size: int) -> str:
    """What _transforms(train=True) does to a training image, in words: config.json's recipe
    and the report's training section."""
    shifts = (f"random shifts of up to {_shift(image_size)} pixels (a crop of the zero-padded "
              "image)")
    return shifts + (" and horizontal flips" if _mirrors(name) else "")


def _transforms(name: str, image_size: int, in_channels: int | None, train: bool):
    """Resize (where the native size differs and the loader has not: _DecodedImages), light
    augmentation for training only, normalise, and widen grey to the channels the model wants.
    ImageFolder already converts to RGB."""
    from torchvision import transforms as T

    mean, std = STATS[name]
    steps = []
    if NATIVE_SIZE.get(name, image_size) != image_size:
        steps.append(T.Resize((image_size, image_size)))
    if train:
        steps.append(T.RandomCrop(image_size, padding=_shift(image_size)))
        if _mirrors(name):
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


def check_present(name: str, data_dir: str, download: bool) -> None:
    """Refuse a torchvision set whose files are not in ``data_dir`` (and not to be
    downloaded) before a run is made for it, with the message loading it would give. MNIST's
    older processed/ files (training.pt, test.pt) are read by torchvision as well."""
    root = Path(data_dir).expanduser()
    folder, files = _expected_files(name, root)
    legacy = [folder.parent / "processed" / f for f in ("training.pt", "test.pt")]
    if download or all((folder / file).is_file() for file in files) or (
            name.endswith("mnist") and all(path.is_file() for path in legacy)):
        return
    raise _no_data(name, root, download)


def _no_data(name: str, root: Path, download: bool) -> PipelineError:
    folder, files = _expected_files(name, root)
    hint = "" if download else "; pass --download to fetch it where the network allows"
    return PipelineError(f"--dataset {name}: no usable data in {folder} (expected "
                         f"{', '.join(files)}){hint}")


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
            raise _no_data(name, root, download) from exc
        except OSError as exc:
            raise PipelineError(f"--dataset {name}: cannot read {root}: {exc}") from exc

    augmented, plain, test = load(True, True), load(True, False), load(False, False)
    labels = torch.as_tensor(augmented.targets).numpy()
    train_idx, val_idx = stratified_split(labels, val_fraction, seed)
    subset = torch.utils.data.Subset
    channels = in_channels or len(STATS[name][0])
    return DataSplits(subset(augmented, sorted(train_idx)), subset(plain, sorted(val_idx)), test,
                      subset(plain, sorted(train_idx)), num_classes=len(augmented.classes),
                      in_channels=channels, image_size=image_size, data_dir=str(root.absolute()),
                      classes=tuple(augmented.classes), preprocessing=_pil_preprocessing(name),
                      augmentation=augmentation_of(name, image_size))


for _name in TORCHVISION_SETS:
    register_dataset(_name)(
        lambda name=_name, image_size=32, seed=0, data_dir="data", download=False,
        val_fraction=0.1, in_channels=None, **_: _torchvision_splits(
            name, image_size, seed, data_dir, download, val_fraction, in_channels))


# Pixels of decoded images kept in memory: every image of a set of 32x32 photos up to 350,000
# of them, or 7,000 at 224x224; past it the rest are decoded each time they are read.
DECODED_BYTES = 1 << 30


class _DecodedImages:
    """ImageFolder's loader: each file decoded, converted to RGB and resized once (what
    torchvision's default loader and Resize do: PIL's bilinear resize), then kept while the
    pixels kept stay within DECODED_BYTES. ImageFolder alone opens and decodes every file again
    each epoch, in the training process: reading photos10's 9,000 training images (32x32 JPEGs)
    with their augmentation took 2.9 s, 1.2 s kept, of mobilenet_v2's 16 s epochs (Zen 4).
    Augmentation still draws afresh on each read."""

    def __init__(self, image_size: int) -> None:
        self.size, self.budget = image_size, DECODED_BYTES
        self.kept: dict[str, object] = {}
        self.bytes = 0

    def __call__(self, path: str):
        image = self.kept.get(path)
        if image is None:
            try:
                image = self._decode(path)
            except Exception as exc:  # changed on disk since it was read: name the file
                raise PipelineError(f"--dataset imagefolder: {path} cannot be read: "
                                    f"{exc}") from exc
            footprint = self.size * self.size * 3
            if self.bytes + footprint <= self.budget:
                self.kept[path] = image
                self.bytes += footprint
        return image

    def _decode(self, path: str):
        from torchvision.transforms import functional as F

        from stages.data.preprocess import in_colour

        # As predict decodes: 16-bit grey scaled to 8 bits (convert alone clips it to white).
        return F.resize(in_colour(path, "RGB"), [self.size, self.size])

    def unreadable(self, paths: list[str]) -> list[str]:
        """Files PIL cannot decode completely (zero bytes, truncated, or not an image at all);
        the readable ones are decoded and kept on the way."""
        bad = []
        for path in paths:
            try:
                self(path)
            except Exception:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
                bad.append(path)
        return bad


def _relative(path: str, root: Path) -> str:
    return Path(path).relative_to(root).as_posix()


def _drop_images(folder_dataset, bad: set[str]) -> None:
    kept = [(p, t) for p, t in folder_dataset.samples if p not in bad]
    folder_dataset.samples = folder_dataset.imgs = kept
    folder_dataset.targets = [t for _, t in kept]


def _check_classes(found, path: Path, least: int, held_out=()) -> None:
    """Two classes or more, each with ``least`` images: one class trains nothing (its loss is
    zero whatever the weights), and every class is split; each of ``held_out`` (its
    ImageFolder and path) has the same classes."""
    from collections import Counter

    for other, other_path in held_out:
        if other.classes != found.classes:
            raise PipelineError(f"--dataset imagefolder: {path} and {other_path} have different "
                                "class subfolders")
        if not other.samples:  # every file skipped as unreadable: nothing to score or choose on
            raise PipelineError(f"--dataset imagefolder: {other_path} has no readable image "
                                "left; put readable images in it")
    if len(found.classes) < 2:
        raise PipelineError(f"--dataset imagefolder: {path} has one class subfolder "
                            f"({found.classes[0]}); a classifier needs two or more")
    counts = Counter(found.targets)
    short = next((name for i, name in enumerate(found.classes) if counts[i] < least), None)
    if short is not None:
        uses = {3: "test, validation and training", 2: "validation and training"}.get(
            least, "training")
        raise PipelineError(f"--dataset imagefolder: class {short!r} in {path} has "
                            f"{counts[found.class_to_idx[short]]} image(s); give every class "
                            f"{least} or more (one each for {uses})")


def _from_split_folders(found: dict, folder, val_fraction: float, seed: int):
    """(augmented training set, plain training set, training indices, val, test) of an image
    folder's split folders (``found``: split_folders): test/ is the test split where there is
    one and val/ the validation split; with one of the two, it is the test split and
    validation is drawn from train/."""
    import torch

    train_path = found["train"]
    test_path = found.get("test", found.get("val"))
    val_path = found["val"] if "test" in found and "val" in found else None
    augmented, plain = folder(train_path, True, True), folder(train_path, False, False)
    test = folder(test_path, False, True)
    val = folder(val_path, False, True) if val_path else None
    _check_classes(augmented, train_path, least=1 if val else 2,
                   held_out=[(test, test_path)] + ([(val, val_path)] if val else []))
    if val:
        return augmented, plain, list(range(len(augmented))), val, test
    train_idx, val_idx = stratified_split(augmented.targets, val_fraction, seed)
    return augmented, plain, train_idx, torch.utils.data.Subset(plain, sorted(val_idx)), test


def _from_one_folder(root: Path, folder, val_fraction: float, seed: int, test_fraction: float):
    """The same of one folder of class folders, split twice: the test split (``test_fraction``,
    with a fixed seed), then validation from the rest."""
    import torch

    augmented, plain = folder(root, True, True), folder(root, False, False)
    _check_classes(augmented, root, least=3)  # split twice: test, then validation
    train, val, test = three_splits(augmented.targets, test_fraction, val_fraction, seed)
    subset = torch.utils.data.Subset
    return augmented, plain, train, subset(plain, sorted(val)), subset(plain, sorted(test))


@register_dataset("imagefolder")
def imagefolder(image_size: int = 32, seed: int = 0, data_dir: str = "data",
                val_fraction: float = 0.1, in_channels: int | None = None,
                skip_bad_images: bool = False, known_unreadable: frozenset | None = None,
                test_fraction: float | None = TEST_FRACTION, **_: object) -> DataSplits:
    """A folder of class subfolders: its train/, val/ and test/ where it has them (train/ with
    one of the others: that one is the test split, and validation is drawn from train/),
    otherwise one folder split in three (``test_fraction`` None: val_fraction's share, as runs
    before 4f94e1f were). Every file is decoded to find those it cannot read, unless
    ``known_unreadable`` names them (relative to ``data_dir``: what training skipped)."""
    import torch

    from stages.data.image_folder import VisibleImageFolder

    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise PipelineError(f"--dataset imagefolder: {root} is not a folder; point --data-dir at "
                            "a folder of class subfolders (or with train/ and val/ inside)")

    skipped, scanned, decoded = 0, {}, _DecodedImages(image_size)

    def folder(path: Path, augment: bool, count: bool):
        """ImageFolder of ``path``; ``count``: add its skipped files to the total (each file is
        read by two datasets, with and without augmentation, but counted once)."""
        nonlocal skipped
        try:
            found = VisibleImageFolder(str(path), loader=decoded, transform=_transforms(
                "imagefolder", image_size, in_channels, augment))
        except (FileNotFoundError, RuntimeError) as exc:
            raise PipelineError(f"--dataset imagefolder: {path}: {exc}; each class needs a "
                                "subfolder of images") from None
        if path not in scanned:  # each folder is opened twice; decode its files once
            files = [p for p, _ in found.samples]
            scanned[path] = (decoded.unreadable(files) if known_unreadable is None else
                             [p for p in files if _relative(p, root) in known_unreadable])
        bad = scanned[path]
        if bad and not skip_bad_images:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise PipelineError(f"--dataset imagefolder: {len(bad)} unreadable image(s): {shown}; "
                                "remove them or pass --skip-bad-images")
        if bad:
            _drop_images(found, set(bad))
            skipped += len(bad) if count else 0
        return found

    subset = torch.utils.data.Subset
    found = split_folders(root)
    test_fraction = None if found else val_fraction if test_fraction is None else test_fraction
    augmented, plain, train_idx, val, test = (
        _from_split_folders(found, folder, val_fraction, seed) if found
        else _from_one_folder(root, folder, val_fraction, seed, test_fraction))
    return DataSplits(subset(augmented, sorted(train_idx)), val, test,
                      subset(plain, sorted(train_idx)), num_classes=len(augmented.classes),
                      in_channels=in_channels or 3, image_size=image_size,
                      skipped_images=skipped, classes=tuple(augmented.classes),
                      skipped_files=tuple(sorted(_relative(p, root) for bad in scanned.values()
                                                 for p in bad)),
                      data_dir=str(root.absolute()), test_fraction=test_fraction,
                      preprocessing=_pil_preprocessing("imagefolder"),
                      augmentation=augmentation_of("imagefolder", image_size))

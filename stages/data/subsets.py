"""The images each choice is made on: calibration images for static quantization, the selection
set (--auto, the recommendation) and the halves of the validation split qat and the report
use. Never test images."""
from __future__ import annotations

from stages.data.datasets import DataSplits
from stages.data.loaders import batches, make_loader
from stages.run.errors import PipelineError


def default_calibration_samples(image_size: int) -> int:
    """Training images calibration observes where --calibration-samples is not given: 512 up to
    64x64, then as many as hold the same pixels, at least 128. Each image gives every channel
    one value per pixel, so 128 at 224x224 give 6.4 million where 512 at 32x32 give 0.5; at
    224x224 on resnet18 they cut quantize from 8 min 28 s to 7 min 1 s, with torch-static's
    held-out drop -0.76 points all-int8 and -0.38 with one layer float (-0.43 and 0 with two
    at 512; AMX Xeon), and the images left over join the held-out set (1,309 from 925)."""
    return max(128, min(512, 512 * 64 * 64 // (image_size * image_size)))


def calibration_batches(splits: DataSplits, num_samples: int, batch_size: int, seed: int):
    """Tensors of training images (never test images) for static quantization to observe."""
    import torch

    if num_samples < 1:
        raise ValueError(f"--calibration-samples must be at least 1, got {num_samples}")
    if len(splits.calibration) == 0:
        raise ValueError("the training split is empty; static quantization needs calibration data")
    chosen = torch.utils.data.Subset(splits.calibration,
                                     _seeded_order(len(splits.calibration), seed)[:num_samples])
    return [images for images, _ in make_loader(chosen, batch_size)]


def _seeded_order(size: int, seed: int) -> list[int]:
    import torch

    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def spread_images(dataset, count: int, seed: int):
    """``count`` images drawn across ``dataset`` by ``seed``, in index order: an image folder's
    split lists its classes one after another, so its first 128 images are all one class."""
    import torch

    chosen = sorted(_seeded_order(len(dataset), seed)[:count])
    return torch.stack([dataset[i][0] for i in chosen]) if chosen else torch.empty(0)


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


# Quantization damage is measured as flips between two models on the same images: on a model
# where 4-5% of predictions flip (efficientnet_b0 on notMNIST), the change in accuracy on 1,024
# images has a standard error near 0.65 points, and a search that stops at the first candidate
# within the budget keeps the one whose noise flattered it (-0.39 held-out, -2.05 on test).
# 4,096 images halve that, and the budget holds the drop at 95% confidence, so that what noise
# is left does not choose (stats.worst_change); a data set with fewer held-out images uses what
# it has, and its wider bound says so.
SELECTION_IMAGES = 4096


def validation_halves(size: int) -> tuple[list[int], list[int]]:
    """Indices into the validation split: (the half qat chooses its epoch on, the half the
    report judges fine-tuned variants on). Every other image, so that both halves keep the
    split's class mix; choosing and judging on the same images would favour the epoch that fit
    their noise (a winner's curse: on 144 images, 91.0% chosen, 4 points less on test)."""
    return list(range(0, size, 2)), list(range(1, size, 2))


def selection_set(splits: DataSplits, calibration_samples: int, seed: int,
                  limit: int = SELECTION_IMAGES, also_calibrated=()):
    """The images every choice is made on (--auto, the recommendation): the validation split
    plus training images that calibration did not see, at most ``limit``. Never test images.
    Quantization damage is a difference between two models on the same images, so training
    images serve, and make the set large enough that one flipped image does not decide.
    Only the chosen images are ever decoded (a large training split is not read whole).
    A validation split larger than ``limit`` gives a seeded sample of itself, in order: its
    first images would be its first classes where it lists them in order (an image folder),
    as photos10's first training images were 7 of its 10 classes (stages/training/batchnorm.py).
    ``also_calibrated``: (samples, seed) of other calibrations whose images stay out too (the
    report's variants may come from quantize runs with other settings)."""
    import torch

    val = range(len(splits.val))
    if len(val) > limit:
        val = sorted(_seeded_order(len(val), seed)[:limit])
    seen = {index for samples, other_seed in also_calibrated
            for index in _seeded_order(len(splits.calibration), other_seed)[:samples]}
    unseen = [index for index in _seeded_order(len(splits.calibration), seed)[calibration_samples:]
              if index not in seen][:limit - len(val)]
    parts = [torch.utils.data.Subset(splits.val, val),
             torch.utils.data.Subset(splits.calibration, unseen)]
    return torch.utils.data.ConcatDataset(parts)


def tuning_images(splits: DataSplits, calibration_samples: int, seed: int,
                  limit: int = SELECTION_IMAGES):
    """(images, labels) of ``selection_set`` as two tensors."""
    import torch

    images, labels = zip(*batches(selection_set(splits, calibration_samples, seed, limit)))
    return torch.cat(images), torch.cat(labels)

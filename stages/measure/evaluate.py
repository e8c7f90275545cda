"""Logits and accuracy of any predictor (a PyTorch module, an ONNX Runtime or OpenVINO model)
over a batch or a data set: the one way every step scores a model."""
from __future__ import annotations

from typing import Callable

from stages.data.loaders import batches

# Top-1 agreement below which two runtimes' versions of one model are said to disagree (the
# report's parity table) and ort-qat is not kept.
PARITY_MIN_AGREEMENT = 0.98

# ONNX Runtime's arena and an OpenVINO request keep the memory of the largest batch they ran
# for the life of the session: scored 256 images at a time at 224x224, an onnx-fp32 session of
# efficientnet_b0 grew 4.1 GB (0.8 at 32), and the report's measuring child, which keeps
# every variant loaded, reached 24 of 25 GB. A scoring batch holds at most the pixels of 32
# images of 224x224 (256 images at 32x32 and below, as before).
SCORING_PIXELS = 32 * 224 * 224


def scoring_batch_size(shape) -> int:
    """Images a scoring batch holds, for images of ``shape`` (..., height, width)."""
    return max(1, min(256, SCORING_PIXELS // (int(shape[-2]) * int(shape[-1]))))


def predict(model, images, batch_size: int | None = None, device=None, autocast=None):
    """Logits of ``model`` for a tensor of images, in eval mode, as fp32 on the CPU.
    ``autocast`` is a context factory for a model served in reduced precision."""
    import contextlib

    import torch

    device = device or torch.device("cpu")
    batch_size = batch_size or scoring_batch_size(images.shape)
    model.eval()
    outputs = []
    with torch.inference_mode(), (autocast or contextlib.nullcontext)():
        for start in range(0, len(images), batch_size):
            outputs.append(model(images[start:start + batch_size].to(device)).float().cpu())
    return torch.cat(outputs) if outputs else torch.empty(0)


def top_k_hits(logits, labels, k: int):
    """Whether each label is among the ``k`` highest logits, ties going to the lower class
    index as argmax's do: topk's order among equal logits is unspecified, and an int8 model's
    dequantized outputs tie often."""
    order = logits.argsort(dim=1, descending=True, stable=True)[:, :k]
    return order.eq(labels[:, None]).any(dim=1)


def predict_dataset(predict_batch: Callable, dataset, batch_size: int | None = None):
    """(logits, labels) of a whole data set through ``predict_batch``."""
    import torch

    if batch_size is None:
        batch_size = scoring_batch_size(dataset[0][0].shape) if len(dataset) else 1
    logits, labels = [], []
    for images, targets in batches(dataset, batch_size):
        logits.append(predict_batch(images))
        labels.append(targets)
    if not logits:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    return torch.cat(logits), torch.cat(labels)


def top1_hits(logits, labels):
    """Whether each top-1 prediction is right, image by image (a bool tensor): what a paired
    comparison of two models on the same images needs."""
    return logits.argmax(dim=1) == labels if len(labels) else labels.bool()


def hit_share(hits) -> float:
    """Share of the hits that are right, as an exact ratio of counts."""
    return int(hits.sum()) / len(hits) if len(hits) else float("nan")


def accuracy(logits, labels) -> float:
    return hit_share(top1_hits(logits, labels))


def dataset_hits(model, dataset, device=None):
    return top1_hits(*predict_dataset(lambda images: predict(model, images, device=device),
                                      dataset))


def dataset_accuracy(model, dataset, device=None) -> float:
    return hit_share(dataset_hits(model, dataset, device))


def compare_logits(reference, candidate) -> dict:
    """How far two models' logits are apart on the same inputs."""
    return {
        "max_abs_diff": float((reference - candidate).abs().max()),
        "top1_agreement": float((reference.argmax(1) == candidate.argmax(1)).float().mean()),
        "samples": len(reference),
    }

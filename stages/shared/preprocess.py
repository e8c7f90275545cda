"""How one image file becomes a model's input: the evaluation transform of the run's data set.

It needs numpy and Pillow alone, so `pipeline export` copies this file beside the model, and
the exported folder's predict.py preprocesses exactly as `pipeline predict` and
`pipeline.load(...).preprocess` do. The numbers come from preprocessing.json:

    image_size, channels   the model's input: channels x image_size x image_size
    colour                 "L" (grey) or "RGB": the image is converted to it first
    source_size            the data set's own size where it is not a file format (the digits'
                           8x8): an image is reduced to it, normalised, then resized up
    resize                 "pil-bilinear" (torchvision's Resize on PIL images) or
                           "bilinear-half-pixel" (torch's interpolate, align_corners=False)
    mean, std              per channel of the colour, on values scaled to [0, 1]
    classes                the name of each output index
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def read_spec(path) -> dict:
    return json.loads(Path(path).read_text())


def _resize_half_pixel(array: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of (C, H, W) to (C, size, size) with half-pixel centres and clamped
    edges: torch.nn.functional.interpolate(mode="bilinear", align_corners=False)."""
    def weights(n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        position = (np.arange(size) + 0.5) * (n_in / size) - 0.5
        position = np.clip(position, 0, n_in - 1)
        low = np.floor(position).astype(int)
        high = np.minimum(low + 1, n_in - 1)
        return low, high, (position - low).astype(np.float32)

    y0, y1, wy = weights(array.shape[1])
    x0, x1, wx = weights(array.shape[2])
    rows = array[:, y0, :] * (1 - wy)[None, :, None] + array[:, y1, :] * wy[None, :, None]
    return rows[:, :, x0] * (1 - wx) + rows[:, :, x1] * wx


def preprocess(image, spec: dict) -> np.ndarray:
    """A path or PIL image as the model's input, float32 (channels, size, size)."""
    if not isinstance(image, Image.Image):
        with Image.open(image) as opened:
            image = opened.convert(spec["colour"])
    else:
        image = image.convert(spec["colour"])
    size = spec["image_size"]
    if spec.get("source_size"):
        source = spec["source_size"]
        image = image.resize((source, source), Image.BILINEAR)
    elif image.size != (size, size):
        image = image.resize((size, size), Image.BILINEAR)
    array = np.asarray(image, dtype=np.float32) / 255.0
    array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
    mean = np.asarray(spec["mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(spec["std"], dtype=np.float32)[:, None, None]
    array = (array - mean) / std
    if spec.get("source_size") and spec["source_size"] != size:
        array = _resize_half_pixel(array, size)
    if array.shape[0] < spec["channels"]:  # grey data, a model that takes 3 channels
        array = np.repeat(array, spec["channels"], axis=0)
    return np.ascontiguousarray(array, dtype=np.float32)


def image_files(paths) -> tuple[list[Path], list[Path]]:
    """(files, empty folders): files given as they are, folders searched for image files."""
    files, empty = [], []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
            files += found
            if not found:
                empty.append(path)
        else:
            files.append(path)
    return files, empty


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def predict_files(files, spec: dict, logits_of, batch_size: int = 64, top_k: int = 1):
    """For each file, in order: (path, [(class, probability), ...] most probable first), or
    (path, why) for a file that is not a readable image (skipped). ``logits_of`` takes a batch
    (N, C, H, W) of preprocessed images and returns logits (N, classes)."""
    top_k = min(top_k, len(spec["classes"]))
    for start in range(0, len(files), batch_size):
        ready, inputs = [], []
        for path in files[start:start + batch_size]:
            try:
                inputs.append(preprocess(path, spec))
                ready.append(path)
            except Exception as exc:  # Pillow raises many kinds for a file it cannot read
                yield path, " ".join(str(exc).split()) or type(exc).__name__
        if not inputs:
            continue
        probabilities = softmax(np.asarray(logits_of(np.stack(inputs)), dtype=np.float64))
        for path, row in zip(ready, probabilities):
            best = np.argsort(-row)[:top_k]
            yield path, [(spec["classes"][i], float(row[i])) for i in best]


def main(paths, spec: dict, logits_of) -> int:
    """What an exported folder's `python predict.py IMAGE_OR_FOLDER...` does: one line per
    image with its most probable class; unreadable files named on stderr; exit status 1 if any
    was skipped, 2 for a folder with no images."""
    import sys

    files, empty = image_files(paths)
    if empty:
        print(f"predict.py: {', '.join(map(str, empty))} holds no images", file=sys.stderr)
        return 2
    skipped = 0
    for path, result in predict_files(files, spec, logits_of, batch_size=16):
        if isinstance(result, str):
            print(f"predict.py: skipped {path}: {result}", file=sys.stderr)
            skipped += 1
        else:
            name, probability = result[0]
            print(f"{path}: {name} ({probability:.3f})")
    return 1 if skipped else 0

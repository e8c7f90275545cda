"""How one image file becomes a model's input: the evaluation transform of the run's data set.

It needs numpy and Pillow alone, so `pipeline export` copies this file beside the model (with
stages/predict.py, the loop that reads the files), and the exported folder's predict.py
preprocesses exactly as `pipeline predict` and `pipeline.load(...).preprocess` do. The numbers
come from preprocessing.json:

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
import os
import stat
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
              (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a folder"))


def read_spec(path) -> dict:
    return json.loads(Path(path).read_text())


def _resize_half_pixel(array: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of (..., H, W) to (..., size, size) with half-pixel centres and clamped
    edges: torch.nn.functional.interpolate(mode="bilinear", align_corners=False)."""
    def weights(n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        position = (np.arange(size) + 0.5) * (n_in / size) - 0.5
        position = np.clip(position, 0, n_in - 1)
        low = np.floor(position).astype(int)
        high = np.minimum(low + 1, n_in - 1)
        return low, high, (position - low).astype(np.float32)

    y0, y1, wy = weights(array.shape[-2])
    x0, x1, wx = weights(array.shape[-1])
    rows = array[..., y0, :] * (1 - wy)[:, None] + array[..., y1, :] * wy[:, None]
    return rows[..., x0] * (1 - wx) + rows[..., x1] * wx


def _eight_bit(image: Image.Image) -> Image.Image:
    """16-bit grey (PNG, TIFF) scaled to 8 bits: Pillow's convert() clips it at 255 instead,
    which turned every pixel above 255 of 65535 white. Mode I (32-bit integers, how older
    Pillows open 16-bit PNGs) is taken as 16-bit where a pixel is over 255."""
    sixteen = image.mode.startswith("I;16") or (image.mode == "I" and image.getextrema()[1] > 255)
    if sixteen:
        pixels = np.asarray(image).astype(np.float64) / 257.0
        return Image.fromarray(np.clip(np.round(pixels), 0, 255).astype(np.uint8), "L")
    if image.mode == "F":
        raise ValueError("its pixels are 32-bit floats, whose range is unknown; save it with 8 "
                         "or 16 bits per channel")
    return image


class Unreadable(ValueError):
    """A file that is not predicted, and why, in words for the user."""


def read_image(path) -> Image.Image:
    """The image in ``path`` (or an open binary file), decoded, from a regular file alone:
    opening a FIFO waits for a writer forever, and a device never ends. What is over Pillow's
    pixel limit is refused, not warned about on stderr and decoded anyway."""
    # Pillow's warning as the error it warns of, for the whole process: decoding runs in a
    # worker thread, where catch_warnings (which swaps the process's filter list) would race
    # with the main thread's own.
    warnings.filterwarnings("error", category=Image.DecompressionBombWarning)
    try:
        if hasattr(path, "read"):
            return _loaded(path)
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):  # a folder predict could not list: raises why
            os.scandir(path).close()
        kind = next((name for test, name in FILE_KINDS if test(info.st_mode)), "not a file")
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"it is {kind}, not a regular file, so it was not opened")
        # O_NONBLOCK: should the path become a FIFO after the check, open still returns.
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise Unreadable("it is not a regular file, so it was not read")
            return _loaded(file)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise Unreadable(f"it has more pixels than Pillow's limit of {Image.MAX_IMAGE_PIXELS:,} "
                         "(its guard against decompression bombs); scale it down first") from None
    except PermissionError:
        raise Unreadable("permission denied: this user cannot read it") from None
    except FileNotFoundError:
        raise Unreadable("no such file (removed, or a link to nothing)") from None
    except Image.UnidentifiedImageError:
        raise Unreadable("not an image file Pillow can read") from None


def _loaded(file) -> Image.Image:
    with Image.open(file) as opened:
        opened.load()
        return opened.copy()


def in_colour(image, colour: str) -> Image.Image:
    """A path or PIL image, decoded, in ``colour`` ("L" or "RGB"), 16-bit scaled to 8 bits: as
    training reads an image folder's files and as predict reads a user's."""
    if not isinstance(image, Image.Image):
        image = read_image(image)
    return _eight_bit(image).convert(colour)


def decode(image, spec: dict) -> np.ndarray:
    """A path or PIL image as uint8 pixels (H, W) or (H, W, 3) in the spec's colour, resized to
    the size the data set's images have before normalising (its source size, or the model's)."""
    image = in_colour(image, spec["colour"])
    side = spec.get("source_size") or spec["image_size"]
    if image.size != (side, side):
        image = image.resize((side, side), Image.BILINEAR)
    return np.asarray(image)


def to_input(pixels: np.ndarray, spec: dict) -> np.ndarray:
    """Decoded uint8 images (N, H, W) or (N, H, W, 3) as the model's input, float32
    (N, channels, size, size): scaled to [0, 1], normalised, resized, widened."""
    array = pixels.astype(np.float32) / 255.0
    array = array[:, None] if array.ndim == 3 else array.transpose(0, 3, 1, 2)
    mean = np.asarray(spec["mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(spec["std"], dtype=np.float32)[:, None, None]
    array = (array - mean) / std
    if array.shape[-1] != spec["image_size"]:  # the digits: reduced, normalised, then resized
        array = _resize_half_pixel(array, spec["image_size"])
    if array.shape[1] < spec["channels"]:  # grey data, a model that takes 3 channels
        array = np.repeat(array, spec["channels"], axis=1)
    return np.ascontiguousarray(array, dtype=np.float32)


def preprocess(image, spec: dict) -> np.ndarray:
    """A path or PIL image as the model's input, float32 (channels, size, size)."""
    return to_input(decode(image, spec)[None], spec)[0]

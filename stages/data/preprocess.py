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


def decode(image, spec: dict) -> np.ndarray:
    """A path or PIL image as uint8 pixels (H, W) or (H, W, 3) in the spec's colour, resized to
    the size the data set's images have before normalising (its source size, or the model's)."""
    if not isinstance(image, Image.Image):
        image = _eight_bit(read_image(image)).convert(spec["colour"])
    else:
        image = _eight_bit(image).convert(spec["colour"])
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


def image_files(paths) -> tuple[list[Path], list[Path]]:
    """(files, empty folders): paths given as they are, and everything in a folder that is
    not a folder itself, whatever its name: Pillow knows an image by its content (a .gif, a
    file with no extension), and what it cannot read is named as skipped, never dropped.
    Hidden files and folders (.DS_Store, .git/) are left out of a folder, as ls leaves them."""
    files, empty = [], []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if not p.is_dir() and not any(
                part.startswith(".") for part in p.relative_to(path).parts))
            files += found
            if not found:
                empty.append(path)
        else:
            files.append(path)
    return files, empty


def printable(text) -> str:
    """``text`` with control characters escaped: a class or file name holding a newline must
    not print a line of its own that reads as another image's result."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def result_line(path, result) -> str:
    """One image's line of text output: its path and its most probable classes."""
    return f"{printable(path)}: " + ", ".join(f"{printable(name)} ({p:.3f})"
                                              for name, p in result)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _decoded(paths, spec: dict) -> tuple[list, list, list]:
    """(paths decoded, their pixels, (path, why) of those that could not be)."""
    ready, pixels, failed = [], [], []
    for path in paths:
        try:
            pixels.append(decode(path, spec))
            ready.append(path)
        except Exception as exc:  # Pillow raises many kinds for a file it cannot read
            failed.append((path, " ".join(str(exc).split()) or type(exc).__name__))
    return ready, pixels, failed


def predict_files(files, spec: dict, logits_of, batch_size: int = 64, top_k: int = 1):
    """For each file, batch by batch (within one, the files skipped first): (path, [(class,
    probability), ...] most probable first), or (path, why) for a file that is not a readable
    image, which is skipped. ``logits_of`` takes a batch
    (N, C, H, W) of preprocessed images and returns logits (N, classes). The next batch is
    decoded in a thread while the model runs on this one (Pillow decodes without the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    top_k = min(top_k, len(spec["classes"]))
    batches = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(_decoded, batches[0], spec) if batches else None
        for index in range(len(batches)):
            ready, pixels, failed = pending.result()
            if index + 1 < len(batches):
                pending = pool.submit(_decoded, batches[index + 1], spec)
            yield from failed
            if not pixels:
                continue
            logits = logits_of(to_input(np.stack(pixels), spec))
            probabilities = softmax(np.asarray(logits, dtype=np.float64))
            for path, row in zip(ready, probabilities):
                # Ties go to the lower class index, as argmax's (int8 outputs tie often).
                best = np.argsort(-row, kind="stable")[:top_k]
                yield path, [(spec["classes"][i], float(row[i])) for i in best]


def arguments(doc: str, folder: Path):
    """An exported folder's command line: predict.py IMAGE_OR_FOLDER... [--top-k K]; then the
    folder's files checked against its manifest.json before the model is loaded (exit 1)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="predict.py", description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="IMAGE_OR_FOLDER")
    parser.add_argument("--top-k", type=int, default=1, help="classes printed per image")
    parser.add_argument("--batch-size", type=int, default=16, help="images predicted together")
    args = parser.parse_args()
    if args.top_k < 1 or args.batch_size < 1:
        parser.error("--top-k and --batch-size take a whole number of at least 1")
    problem = verify_folder(folder)
    if problem:
        print(f"predict.py: {problem}", file=sys.stderr)
        sys.exit(1)
    return args


def print_predictions(files, spec: dict, logits_of, batch_size: int, top_k: int, prog: str,
                      variant: str | None = None) -> int:
    """One line per image on stdout (a JSON object each where ``variant`` is given), each file
    that could not be predicted named on stderr with why; returns how many were skipped."""
    import sys

    skipped = 0
    for path, result in predict_files(files, spec, logits_of, batch_size, top_k):
        if isinstance(result, str):
            print(f"{prog}: skipped {printable(path)}: {result}", file=sys.stderr, flush=True)
            skipped += 1
        elif variant is not None:
            print(json.dumps({"path": str(path), "variant": variant, "top": [
                {"class": name, "probability": p} for name, p in result]}), flush=True)
        else:
            print(result_line(path, result), flush=True)
    return skipped


def skipped_summary(skipped: int, total: int) -> str:
    return (f"{skipped} of {total} file(s) could not be predicted and were skipped (named "
            "above)")


def verify_folder(folder: Path) -> str | None:
    """Why an exported folder's files are not those its manifest.json lists (a file changed,
    truncated or missing), or None when every sha256 matches."""
    import hashlib

    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
        for name, record in files.items():
            digest = hashlib.sha256()
            with open(folder / Path(name).name, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
            if digest.hexdigest() != record["sha256"]:
                return (f"{name} does not match its sha256 in manifest.json (changed or "
                        "truncated since export); export the variant again")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return (f"manifest.json or a file it lists cannot be read ({type(exc).__name__}: "
                f"{exc}); export the variant again")
    return None


def main(args, spec: dict, logits_of) -> int:
    """What an exported folder's `python predict.py IMAGE_OR_FOLDER...` does: one line per
    image with its most probable classes; unreadable files named on stderr; exit status 1 if
    any was skipped, 2 for a path that does not exist or a folder with no files."""
    import sys

    missing = [path for path in args.paths if not Path(path).exists()]
    if missing:
        print(f"predict.py: {', '.join(missing)}: no such file or folder", file=sys.stderr)
        return 2
    files, empty = image_files(args.paths)
    if empty:
        print(f"predict.py: {', '.join(map(str, empty))} holds no files", file=sys.stderr)
        return 2
    skipped = print_predictions(files, spec, logits_of, args.batch_size, args.top_k, "predict.py")
    if skipped:
        print(f"predict.py: {skipped_summary(skipped, len(files))}", file=sys.stderr)
    return 1 if skipped else 0

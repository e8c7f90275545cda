"""Use what the pipeline compressed, from Python:

    import pipeline
    model = pipeline.load("artifacts/runs/20261201-120000", variant="recommended")
    logits = model.predict(["cat.png", "dog.png"])        # numpy, (images, classes)
    model.classes[logits.argmax(1)[0]]

`load` takes a run folder, a run name (in $PIPELINE_ARTIFACTS_DIR or ./artifacts) or nothing for
the latest run, and any variant's name or "recommended" (the report's choice for its largest
batch). Every file is checked against its sha256 in the run's manifest before it is loaded, as
the stages check them, and the variant runs through the same loader the report timed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: numpy is imported where it is used
    import numpy


def open_run(run=None, artifacts_dir=None):
    """A run folder's path, a run's name, or None for the latest run."""
    from stages.run.artifacts import open_run as open_named

    folder = artifacts_dir or os.environ.get("PIPELINE_ARTIFACTS_DIR", "artifacts")
    return open_named(Path(folder), None if run is None else os.fspath(run))


@dataclass
class Model:
    """One variant of a run, loaded and ready: predict logits, preprocess images, name classes."""

    variant: str
    run_name: str
    serving: str
    classes: list[str]
    spec: dict  # preprocessing.json
    _loaded: object

    def preprocess(self, image) -> "numpy.ndarray":
        """A path or PIL image as the model's input (channels, size, size), float32: the
        evaluation transform of the run's data set. Anything else is refused by its type (an
        integer had been taken for an open file's descriptor)."""
        from PIL import Image

        from stages.data.preprocess import preprocess

        if not isinstance(image, (str, os.PathLike, Image.Image)):
            raise TypeError(f"preprocess got a {type(image).__name__}; it takes a path or a PIL "
                            "image (an array is already preprocessed: give it to predict)")
        return preprocess(image, self.spec)

    def predict(self, images) -> "numpy.ndarray":
        """Logits (images, classes) as float32 numpy, for a batch of preprocessed images
        (numpy or torch, (N, C, H, W) or one (C, H, W)) or a list of paths and PIL images.
        Input the model cannot take (raw uint8 pixels, NaN, another size or channel count,
        values preprocessing cannot give) is refused with one line, never answered."""
        import numpy as np
        import torch

        if isinstance(images, (list, tuple)):
            if not images:
                return np.zeros((0, len(self.classes)), np.float32)
            images = np.stack([self._one(image) for image in images])
        batch = torch.from_numpy(self.checked(images))
        if batch.dim() == 3:
            batch = batch[None]
        if len(batch) == 0:
            return np.zeros((0, len(self.classes)), np.float32)
        return self._loaded.predict(batch.contiguous()).numpy()

    def _one(self, image) -> "numpy.ndarray":
        """One item of a list: an array checked, a path or PIL image read and preprocessed.
        Anything else is refused by its type: a list of numbers had reached os.stat, and an
        integer was taken for an open file's descriptor."""
        import numpy as np
        import torch
        from PIL import Image

        if isinstance(image, (np.ndarray, torch.Tensor)):
            return self.checked(image)
        if isinstance(image, (str, os.PathLike, Image.Image)):
            return self._read(image)
        raise TypeError(f"predict got a list holding a {type(image).__name__}; it takes paths, "
                        "PIL images or arrays (np.asarray(...) for array data)")

    def _read(self, image) -> "numpy.ndarray":
        """preprocess(), where a file that cannot be read is named with why, in one line."""
        from stages.predict import printable

        try:
            return self.preprocess(image)
        except Exception as exc:  # Pillow raises many kinds (OSError for a truncated file)
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"{printable(image)}: {why}; remove it from the list, or pass the "
                             "others") from None

    def checked(self, images) -> "numpy.ndarray":
        """``images`` as float32 numpy once they are known to be what this model takes."""
        from pipeline.inputs import checked_batch

        return checked_batch(images, self.spec)

    def __repr__(self) -> str:
        return (f"Model({self.variant!r} of run {self.run_name!r}: {self.serving}; "
                f"{len(self.classes)} classes, input {self.spec['channels']}x"
                f"{self.spec['image_size']}x{self.spec['image_size']})")


def load(run=None, variant: str = "recommended", *, artifacts_dir=None,
         threads: int = 0) -> Model:
    """Load a variant of a run; see the module's docstring."""
    from pipeline.config import MAX_THREADS
    from stages import runtimes
    from stages.data.datasets import preprocessing_of_run
    from stages.measure.machine import inference_threads

    threads = 0 if threads is None else threads
    if (isinstance(threads, bool) or not isinstance(threads, int)
            or not 0 <= threads <= MAX_THREADS):
        raise ValueError(f"threads={threads!r}: give 0 (as many as the machine has, up to 8) or "
                         f"a whole number of threads up to {MAX_THREADS}")
    opened = open_run(run, artifacts_dir)
    name = runtimes.resolve(opened, variant)
    spec = preprocessing_of_run(opened)
    loaded = runtimes.load(opened, name, inference_threads(threads))
    return Model(name, opened.name, loaded.serving, list(spec["classes"]), spec, loaded)


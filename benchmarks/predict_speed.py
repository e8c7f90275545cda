"""How fast `pipeline predict` goes against the speed the report's timing implies.

    .venv/bin/python benchmarks/predict_speed.py [--run NAME] [--artifacts-dir artifacts]
                                                 [--variant recommended] [--images 2000]
                                                 [--batch-size 64]

Writes --images PNG files (the run's test images, repeated, at the model's input size), loads
the variant as `pipeline predict` does, and times predicting all of them at --batch-size:
decoding and preprocessing included, loading excluded. Beside it, the report's harness times
the same variant on a batch of that size, and the images per second that p50 implies. The target
is at least 80% of it. Nothing in the run folder is written.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def write_images(run, folder: Path, count: int) -> list[Path]:
    """The run's test images as 8-bit PNG files, normalisation undone, repeated to ``count``."""
    import numpy as np
    from PIL import Image

    from stages.data.datasets import preprocessing_of_run, splits_of_run

    spec = preprocessing_of_run(run)
    test = splits_of_run(run).test
    if not hasattr(test, "tensors"):
        raise SystemExit("this benchmark writes images from a data set held in memory (digits)")
    images = test.tensors[0].numpy()
    mean = np.asarray(spec["mean"])[:, None, None]
    std = np.asarray(spec["std"])[:, None, None]
    paths = []
    for i in range(count):
        pixels = images[i % len(images)][: len(spec["mean"])] * std + mean
        pixels = np.clip(np.round(pixels * 255), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0))
        path = folder / f"{i:05d}.png"
        image.save(path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None)
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--variant", default="recommended")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    import pipeline
    from pipeline.api import open_run
    from stages.measure import timing
    from stages.measure.machine import cpu_info
    from stages.predict import predict_files

    run = open_run(args.run, args.artifacts_dir)
    model = pipeline.load(run.root, args.variant)
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_images(run, Path(scratch), args.images)
        # As `pipeline predict` runs: decoded, preprocessed and predicted in batches.
        list(predict_files(paths[: args.batch_size], model.spec, model.predict,
                           args.batch_size))  # warm-up
        started = time.perf_counter()
        results = list(predict_files(paths, model.spec, model.predict, args.batch_size))
        seconds = time.perf_counter() - started
    assert len(results) == len(paths)
    spec = model.spec
    batch = timing.random_batch((args.batch_size, spec["channels"], spec["image_size"],
                                 spec["image_size"]))
    timed = timing.interleaved({model.variant: model._loaded.call_for(batch)}, rounds=10,
                               warmup=3)[model.variant].summary()
    implied = args.batch_size / (timed["p50"] / 1000)
    achieved = len(paths) / seconds
    print(f"run {run.name}, {model.variant} ({model.serving}), {cpu_info()['model']}, "
          f"batch {args.batch_size}")
    print(f"pipeline predict: {len(paths)} images in {seconds:.2f} s: {achieved:.0f} images/s "
          "(decoding and preprocessing included)")
    print(f"the report's harness: p50 {timed['p50']:.2f} ms a batch: {implied:.0f} images/s")
    print(f"predict reaches {achieved / implied:.0%} of it (target: 80%)")


if __name__ == "__main__":
    main()

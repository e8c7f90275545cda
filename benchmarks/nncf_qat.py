"""NNCF's own quantization-aware training against the product's `openvino-qat`, on one run.

    .venv/bin/python benchmarks/nncf_qat.py --run NAME [--artifacts-dir artifacts] [--rounds 15]
        [--epochs N]

The run must have been through `pipeline qat`. This fine-tunes the run's float model the way
NNCF documents for PyTorch (nncf.quantize on the module, a plain training loop, then
openvino.convert_model), with what the run's qat stage had: its epochs, learning rate, SGD with
momentum 0.9, weight decay 5e-4 on kernels alone, its batch size, fp32, and the epoch chosen on
the same half of the validation split; its cosine spans the epochs run (the stage's spans the
epochs asked and is cut by --tuning-time), with no BatchNorm or observer freezes. Then it
prints, for that model (`nncf-qat`) and the run's `openvino-qat`, `openvino-int8` and
`openvino-fp32`: the convolutions OpenVINO runs in int8, test accuracy, accuracy on the other
validation half, and p50 latency at batch 32 (2 threads, timed in the report's harness,
timing.interleaved, with the speed-up's 95% interval).
`nncf-qat`'s HardSigmoid gates are left float as the product's are. The measurement behind
docs/design.md's choice of the QDQ path for `openvino-qat`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import time
from pathlib import Path

import torch

from stages.data.datasets import splits_of_run
from stages.data.loaders import EpochSampler, make_loader
from stages.data.subsets import calibration_batches, validation_halves
from stages.measure import timing
from stages.measure.evaluate import accuracy, predict_dataset
from stages.qat import switch_off_stochastic_depth
from stages.run.artifacts import open_run
from stages.run.trained import float_source
from stages.runtimes import openvino
from stages.runtimes.pytorch import load_float_module
from stages.training.loop import decay_groups
from stages.training.schedule import CosineSchedule

COMPARED = ("openvino-qat", "openvino-int8", "openvino-fp32")


class _Wrapped(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, images):
        return self.inner(images)


def nncf_fine_tuned(run, splits, epochs: int, lr: float, batch_size: int):
    """The run's float model quantized by nncf.quantize (300 training images) and fine-tuned;
    the epoch best on the validation half qat chooses on, as an OpenVINO model."""
    import nncf

    torch.manual_seed(0)
    model = load_float_module(run, float_source(run)).eval()
    switch_off_stochastic_depth(model)
    if isinstance(model, torch.nn.Sequential):
        # NNCF adds its hooks to the model as a child module, which a Sequential would call
        # as a layer (smallcnn: "Module [HookStorage] is missing the required forward").
        model = _Wrapped(model)
    with contextlib.redirect_stdout(io.StringIO()):  # NNCF's progress bars
        model = nncf.quantize(model, nncf.Dataset(calibration_batches(splits, 300, 64, 0)))
    choosing = torch.utils.data.Subset(splits.val, validation_halves(len(splits.val))[0])
    sampler = EpochSampler(len(splits.train), 0)
    loader = make_loader(splits.train, batch_size, sampler)
    optimizer = torch.optim.SGD(decay_groups(model, 5e-4), lr=lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                 CosineSchedule(epochs * len(loader), 0))
    loss_of = torch.nn.CrossEntropyLoss()
    best, started = (-1.0, None, 0), time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            loss_of(model(images), labels).backward()
            optimizer.step()
            schedule.step()
        model.eval()
        with torch.no_grad():
            score = accuracy(*predict_dataset(model, choosing))
        print(f"nncf-qat epoch {epoch + 1}: {score:.2%} on the choosing half "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        if score > best[0]:
            best = (score, copy.deepcopy(model.state_dict()), epoch + 1)
    model.load_state_dict(best[1])
    converted = openvino._openvino().convert_model(
        model, example_input=torch.randn(1, *splits.train[0][0].shape))
    bypassed = openvino.unquantize_hard_gates(converted)
    print(f"nncf-qat: epoch {best[2]} kept; {len(bypassed)} HardSigmoid gates made float")
    return converted


def main() -> None:
    # NNCF compiles its C++ fake quantization on first use and gives up after 60 s, which two
    # slow cores can take: wait for it instead.
    os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs to fine-tune (default: as many as the run's qat stage ran)")
    args = parser.parse_args()
    run = open_run(args.artifacts_dir, args.run)
    splits = splits_of_run(run)
    qat = run.entry("torch-qat")["quantization"]
    if args.epochs is not None and args.epochs < 1:
        parser.error("--epochs must be at least 1")
    models = {"nncf-qat": nncf_fine_tuned(run, splits, args.epochs or qat["epochs"], qat["lr"],
                                          run.recorded_config("qat").get("batch_size", 64))}
    core = openvino.core()
    models |= {name: core.read_model(str(run.verified_path(name))) for name in COMPARED}
    judging = torch.utils.data.Subset(splits.val, validation_halves(len(splits.val))[1])
    batch = torch.stack([splits.test[i][0] for i in range(32)])
    compiled_models, calls = {}, {}
    print("| variant | Conv in int8 | test accuracy | other validation half |")
    print("|---|---|---|---|")
    for name, model in models.items():
        compiled = compiled_models[name] = openvino.compile_model(model, 2)
        predict, call_for = openvino.runner(compiled)  # the product's own calls
        conv = openvino.runtime_op_counts(compiled)["Conv"]
        print(f"| `{name}` | {conv['int8']}/{conv['int8'] + conv['float']} "
              f"| {accuracy(*predict_dataset(predict, splits.test)):.2%} "
              f"| {accuracy(*predict_dataset(predict, judging)):.2%} |")
        calls[name] = call_for(batch)
    timings = timing.interleaved(calls, rounds=args.rounds)  # the report's harness
    for name, timed in timings.items():
        ratio = timing.speedup(timings["openvino-fp32"], timed)
        print(f"{name}: p50 {timed.summary()['p50']:.2f} ms at batch 32, {ratio['ratio']:.2f}x "
              f"({ratio['low']:.2f}-{ratio['high']:.2f}) openvino-fp32")

if __name__ == "__main__":
    main()

"""NCHW against channels_last on this CPU: one training step and one eager forward, per model.

    .venv/bin/python benchmarks/memory_format.py [--models resnet18,mobilenet_v2]
        [--sizes 32,224] [--batch 64] [--serve-batches 1,32] [--steps 8] [--what train,serve]

Training steps run as `pipeline train` runs them on an AMX CPU when it trains in bf16 (oneDNN
capped below AMX): set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 in the environment for those
figures, and leave it unset for the serving ones, which a deployment runs uncapped. Each cell is
the mean over --steps calls after 3 warm-up calls, in ms, "NCHW/channels_last", fp32 and under
bf16 autocast. training/layout.py and runtimes/pytorch.Serving choose channels_last from these.
"""
from __future__ import annotations

import argparse
import time

import torch

from stages.models.build import build_model


def _mean_ms(call, steps: int) -> float:
    for _ in range(3):
        call()
    started = time.perf_counter()
    for _ in range(steps):
        call()
    return (time.perf_counter() - started) / steps * 1000


def _step(model, images, labels, bf16: bool):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return call


def _forward(model, images, bf16: bool):
    def call():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(images)

    return call


def compare(name: str, size: int, batch: int, bf16: bool, training: bool, steps: int) -> str:
    torch.manual_seed(0)
    figures = []
    for layout in (torch.contiguous_format, torch.channels_last):
        model = build_model(name, 10, 3, size).to(memory_format=layout)
        images = torch.rand(batch, 3, size, size).contiguous(memory_format=layout)
        if training:
            call = _step(model.train(), images, torch.randint(0, 10, (batch,)), bf16)
        else:
            call = _forward(model.eval(), images, bf16)
        figures.append(_mean_ms(call, steps))
    return f"{figures[0]:.2f}/{figures[1]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mobilenet_v2")
    parser.add_argument("--sizes", default="32,224")
    parser.add_argument("--batch", type=int, default=64, help="training batch")
    parser.add_argument("--serve-batches", default="1,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--what", default="train,serve", help="train, serve or both")
    args = parser.parse_args()
    wanted = args.what.split(",")
    print("| model | size | what | batch | fp32 NCHW/CL ms | bf16 NCHW/CL ms |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for size in map(int, args.sizes.split(",")):
            cases = ([("train step", args.batch, True)] if "train" in wanted else []) + (
                [("eager forward", int(b), False) for b in args.serve_batches.split(",")]
                if "serve" in wanted else [])
            for what, batch, training in cases:
                cells = [compare(name, size, batch, bf16, training, args.steps)
                         for bf16 in (False, True)]
                print(f"| {name} | {size} | {what} | {batch} | {cells[0]} | {cells[1]} |",
                      flush=True)


if __name__ == "__main__":
    main()

"""The memory layout a model trains in: channels_last (NHWC) wherever its forward runs so, on
the CPU as on CUDA.

oneDNN's CPU convolutions work in NHWC; fed NCHW, they reorder every activation and gradient
on each call. One training step at batch 64 and 32x32, NCHW against channels_last
(benchmarks/memory_format.py on the AMX Xeon, oneDNN capped as bf16 training caps it;
docs/measurements.md): mobilenet_v2 fp32 161 against 81 ms, bf16 224 against 161;
efficientnet_b0 fp32 330 against 144; mnasnet0_5 145 against 55; mobilenet_v3_large 207
against 97; resnet18 116 against 109. At 224x224 resnet18 fp32 took 3.86 against 3.27 s.
Under --time the steps saved are epochs gained.
"""
from __future__ import annotations


def layout_that_runs(model, splits, device) -> str:
    """"channels_last", converting ``model`` to it in place, unless its forward cannot take
    that layout (a user's ``x.view(n, -1)`` over a feature map needs NCHW strides): then
    "NCHW", the model left as it was. The probe is one forward of two blank images in eval
    mode without gradients, so that no statistic or weight moves."""
    import torch

    model.to(memory_format=torch.channels_last)
    probe = torch.zeros(2, splits.in_channels, splits.image_size, splits.image_size,
                        device=device).contiguous(memory_format=torch.channels_last)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(probe)
        return "channels_last"
    except RuntimeError:
        model.to(memory_format=torch.contiguous_format)
        return "NCHW"
    finally:
        model.train(was_training)

"""The memory layout a model trains in: channels_last (NHWC) wherever its forward runs so, on
the CPU as on CUDA.

oneDNN's CPU convolutions work in NHWC; fed NCHW, they reorder every activation and gradient
on each call. One training step at batch 64 and 32x32, NCHW against channels_last (AMX Xeon,
2 cores, oneDNN capped as bf16 training caps it; docs/measurements.md): mobilenet_v2 fp32 148
against 77 ms, bf16 203 against 149; efficientnet_b0 fp32 332 against 132; mnasnet0_5 151
against 53; mobilenet_v3_large 207 against 91; resnet18 104 against 103. At 224x224 resnet18
fp32 took 3.57 against 2.81 s. Under --time the steps saved are epochs gained.
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

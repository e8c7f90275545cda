"""Device and precision policy: what autocast dtype and whether a GradScaler, per device, and
the CPU instruction set that bf16 training may use."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from stages.run.isolated import CAPPED_FOR_TRAINING

# oneDNN 3.12 (torch 2.14) has AMX bf16 convolution bugs that give silently wrong results
# (oneDNN PR #5494: stride larger than the kernel, as in ResNet's 1x1 stride-2 shortcuts at
# small sizes; pytorch#169688): bf16 training of resnet18 went NaN at a different step in each
# run on a Xeon with AMX and was finite and bit-identical with AMX capped. oneDNN reads the cap
# once, before its first primitive, so it is set for the whole process.
AMX_SAFE_ISA = "AVX512_CORE_BF16"


@dataclass(frozen=True)
class Precision:
    name: str  # fp16 | bf16 | fp32

    @property
    def dtype(self):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.name]

    @property
    def uses_scaler(self) -> bool:
        # float16 has too few exponent bits for small gradients; bfloat16 has float32's range.
        return self.name == "fp16"


def resolve_device(device: str):
    import torch

    from stages.run.errors import UsageError

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; "
                         "use --device cpu or auto")
    return torch.device(device)


def resolve_precision(precision: str, device) -> Precision:
    """auto: float16 with GradScaler on CUDA (tensor cores); on a CPU, bfloat16 where the CPU
    has bf16 instructions (AVX-512 BF16, AMX), else float32: elsewhere bf16 is emulated, and
    the small test model trained about 6x slower in it than in fp32 on the AMD EPYC here."""
    if precision != "auto":
        return Precision(precision)
    if device.type == "cuda":
        return Precision("fp16")
    from stages.measure.machine import cpu_has_bf16

    return Precision("bf16" if cpu_has_bf16() else "fp32")


def auto_precision_note(precision: Precision, asked: str, device) -> str | None:
    """What a user is told when auto did not pick mixed precision."""
    if asked == "auto" and device.type == "cpu" and precision.name == "fp32":
        return ("--precision auto: this CPU has no bf16 instructions (AVX-512 BF16 or AMX), "
                "where bf16 is emulated and slower than fp32, so `amp` trains in fp32 here; "
                "--precision bf16 trains in bf16 anyway")
    return None


def cap_isa_for_bf16_training(precision: str, device: str) -> str | None:
    """Cap oneDNN below AMX when this process will train in bf16 on a CPU that has AMX and the
    user has not chosen a cap; returns the cap set, if any. Must run before oneDNN's first
    primitive (any convolution) to take effect."""
    from stages.measure.machine import cpu_info

    if "amx_bf16" not in cpu_info()["flags"] or "ONEDNN_MAX_CPU_ISA" in os.environ:
        return None
    if device == "cuda" or precision in ("fp16", "fp32"):
        return None
    if device == "auto":
        import torch

        if torch.cuda.is_available():  # training goes to the GPU
            return None
    os.environ["ONEDNN_MAX_CPU_ISA"] = AMX_SAFE_ISA
    # Marked as training's, so that what times or serves a variant runs in a process of its
    # own without it (stages/run/isolated.py): a deployment gets AMX.
    os.environ[CAPPED_FOR_TRAINING] = AMX_SAFE_ISA
    return AMX_SAFE_ISA


def autocast(precision: Precision, device):
    import torch

    if precision.name == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.dtype)


def grad_scaler(precision: Precision, device):
    import torch

    return torch.amp.GradScaler(device.type, enabled=precision.uses_scaler)


def seed_everything(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool, device) -> None:
    """torch.use_deterministic_algorithms, with what CUDA needs beside it: cuDNN's benchmark
    off, and a fixed cuBLAS workspace (torch 2.14 no longer insists, older releases do, and
    it must be set before the first cuBLAS call)."""
    import torch

    if enabled and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)

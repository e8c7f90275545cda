"""Device and precision policy: what autocast dtype and whether a GradScaler, per device."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

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

    from stages.errors import UsageError

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available; "
                         "use --device cpu or auto")
    return torch.device(device)


def resolve_precision(precision: str, device) -> Precision:
    """auto: float16 with GradScaler on CUDA (tensor cores), bfloat16 on CPU (no scaler needed)."""
    if precision == "auto":
        return Precision("fp16" if device.type == "cuda" else "bf16")
    return Precision(precision)


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

"""Safe loading: torch.load with weights_only, and why a refused file was refused, in words.

Nothing in the project unpickles arbitrary objects: a checkpoint or a user's weights file loads
only tensors and plain containers, so a file that would run code is refused by name.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stages.run.errors import PipelineError


def load_checkpoint(path: Path) -> Any:
    """torch.load that never unpickles code: only tensors and plain containers load."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            # Quantized tensors load through deprecated paths (TypedStorage, quantized dtypes);
            # and pickles of other protocols are noted; neither says anything about this file.
            warnings.filterwarnings("ignore", category=UserWarning,
                                    module=r"torch\.(_utils|_weights_only_unpickler)")
            # A TorchScript file: torch's advice to call torch.jit.load; refused below.
            warnings.filterwarnings("ignore", message=".*looks like a TorchScript archive",
                                    category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise PipelineError(load_failure(Path(path), exc)) from exc


PICKLE_START = 0x80  # the PROTO opcode every pickle of protocol 2 or later begins with
ZIP_START = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6


def load_failure(path: Path, exc: BaseException) -> str:
    """Why a weights-only load failed, in our words: what the file is not, or that it was
    refused because loading it would run code (never PyTorch's advice to load it anyway)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as error:
        return f"cannot read {path}: {error.strerror}"
    if not head:
        return f"{path} is empty: it is not a weights file; write it again with torch.save"
    if head != ZIP_START and head[0] != PICKLE_START:
        return (f"{path} is not a PyTorch weights file (neither torch.save's zip archive nor a "
                "pickle); give a state_dict or checkpoint saved with torch.save")
    text = str(exc)
    if "TorchScript archive" in text:  # torch.jit.save's: a program, not weights
        return (f"{path} is a TorchScript file (torch.jit.save), a program rather than weights; "
                "save the weights alone (torch.save(model.state_dict(), path)) and give that "
                "file")
    named = re.findall(r"GLOBAL ([\w.]+)", text)
    if "Weights only load failed" in text:
        what = f" (it names {named[0]}, not only tensors)" if named else ""
        return (f"{path} was refused: loading it would run code from the file{what}; save the "
                "weights alone (torch.save(model.state_dict(), path)) and give that file")
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    return f"cannot load {path}: {first}; the file is truncated or corrupt"

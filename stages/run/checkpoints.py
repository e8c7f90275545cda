"""Training checkpoints in a run: numbered and best, kept k at a time, found again on resume.

A checkpoint holds everything the loop needs to continue exactly where it stopped (weights,
optimizer, LR schedule, scaler, RNG states, epoch and position in the epoch, the epoch's
running sums), so a resumed run on CPU ends bit-identical to one that was never interrupted
(with --workers, where it resumes at an epoch's start: stages/data/loaders.py says why).
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from pathlib import Path

from stages.run.artifacts import Run
from stages.run.errors import PipelineError
from stages.run.files import atomic_torch_save
from stages.run.loading import load_checkpoint
from stages.run.progress import say


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints_of(run: Run, variant: str) -> list[tuple[int, str]]:
    """(global step, manifest name) of a variant's numbered checkpoints, newest first."""
    found = [(entry["step"], name) for name, entry in run.artifacts().items()
             if entry["kind"] == "checkpoint" and entry.get("parent") == variant
             and "step" in entry]
    return sorted(found, reverse=True)


def newest_good_checkpoint(run: Run, variant: str) -> tuple[str, dict] | None:
    """The newest checkpoint that matches its sha256 and loads; older ones are the fallback."""
    for _, name in checkpoints_of(run, variant):
        try:
            path = run.verified_path(name)
        except PipelineError as exc:  # truncated or bit-flipped: the previous one will do
            say(f"resume: skipping {exc}")
            continue
        # A file that matches the manifest but will not load as weights was written by someone
        # else, manifest and all: refuse it rather than fall back silently.
        return name, load_checkpoint(path)
    return None


def best_weights(run: Run, variant: str, best_epoch: int) -> dict | None:
    """The weights of the best checkpoint (chosen on validation), for a run resumed from a
    checkpoint whose best epoch is ``best_epoch``. None where the file holds another epoch: a
    stop between the best's write and its checkpoint's leaves the best one epoch ahead, and
    that epoch is trained again; and where the file is not the one the manifest lists (a stop
    between its rename and the manifest's write), which would otherwise refuse every resume."""
    name = f"{variant}/checkpoint-best"
    if name not in run.artifacts():
        return None
    try:
        path = run.verified_path(name)
    except PipelineError as exc:
        say(f"resume: the best epoch's weights are not kept ({exc})")
        return None
    best = load_checkpoint(path)
    return best["model"] if best["position"]["epoch"] == best_epoch else None


class Checkpointer:
    """Writes numbered checkpoints, keeps the newest ``keep`` and the best, on rank 0 only."""

    def __init__(self, run: Run, variant: str, folder: Path, keep: int, config_dict: dict):
        self.run, self.variant, self.folder, self.keep = run, variant, folder, keep
        self.config_dict = config_dict

    def save(self, state: dict, best: bool) -> None:
        step = state["position"]["global_step"]
        name = f"{self.variant}/checkpoint-step{step:07d}"
        path = self.folder / f"checkpoint-step{step:07d}.pt"
        # The best first: a checkpoint that says its epoch was the best then always has the
        # best's file beside it, whenever the process is stopped.
        if best:  # the weights alone: a resume takes the rest from the newest checkpoint
            atomic_torch_save({"model": state["model"], "position": state["position"]},
                              self.folder / "checkpoint-best.pt")
            self.run.register(f"{self.variant}/checkpoint-best", self.folder / "checkpoint-best.pt",
                              kind="checkpoint-best", stage="train", parent=self.variant,
                              step=step, epoch=state["position"]["epoch"])
        atomic_torch_save(state, path)
        self.run.register(name, path, kind="checkpoint", stage="train", parent=self.variant,
                          config=self.config_dict, step=step, epoch=state["position"]["epoch"])
        self.run.register_alias(f"{self.variant}/checkpoint-last", of=name)
        for _, old in checkpoints_of(self.run, self.variant)[self.keep:]:
            self.run.unregister(old)


def cpu_state_dict(model, clone: bool = False) -> OrderedDict:
    """The model's weights on the CPU as a state_dict that loads back: with the state_dict's
    ``_metadata`` (each module's version), without which some modules refuse to load
    (torchvision's MNASNet raises "version should be set to 1 or 2"). Contiguous whatever
    layout the model trained in (channels_last), so that a file does not depend on it."""
    own = model.state_dict()
    weights = OrderedDict((k, v.detach().cpu().contiguous().clone() if clone
                           else v.detach().cpu().contiguous()) for k, v in own.items())
    return with_metadata(weights, own)


def with_metadata(weights: dict, *sources) -> OrderedDict:
    """``weights`` as an OrderedDict carrying the ``_metadata`` of the first source that has
    one (a state_dict read from a file, then the model's own)."""
    weights = OrderedDict(weights)
    found = next((m for m in (getattr(s, "_metadata", None) for s in sources) if m), None)
    if found is not None:
        weights._metadata = found
    return weights


def weights_digest(state_dict: dict) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state_dict.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()

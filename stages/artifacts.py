"""The run folder: atomic writes, manifest.json with sha256 of every artifact, safe loading.

A stage reads only what the manifest lists and checks its sha256 first, so a file that was
truncated, bit-flipped or swapped after it was written is caught by name before it is used.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import json
import os
import platform
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from stages.errors import PipelineError, UsageError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
TEMP_SUFFIX = ".tmp"
# Errors of the disk rather than of the code: full, quota, read-only, I/O.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}


# ---------------------------------------------------------------- atomic writes


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some file systems do not allow opening a folder
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    Tools that insist on writing a file themselves (torch.onnx, ONNX Runtime's quantizer) write
    to the temporary path, so a crash never leaves a half file under the real name.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX,
                                        dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise PipelineError(f"cannot write in {path.parent}: {exc.strerror}; choose a writable "
                            "--artifacts-dir") from None
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise PipelineError(f"writing {path} failed: {exc.strerror}; nothing was written under "
                            "that name (free some space or choose another --artifacts-dir)") from None
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temporaries(folder: Path) -> int:
    """Delete temporary files a killed process left behind (never a file under a real name)."""
    removed = 0
    for stale in Path(folder).glob(f".*{TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(file)`` on a temporary file and rename it to ``path`` once it is on disk."""
    with atomic_path(path) as tmp:
        with open(tmp, mode) as f:
            write(f)
            f.flush()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- safe loading


def load_checkpoint(path: Path) -> Any:
    """torch.load that never unpickles code: only tensors and plain containers load."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            # Quantized tensors load through deprecated paths (TypedStorage, quantized dtypes);
            # the notices say nothing about this file.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._utils")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(f"cannot load {path}: {first_line[:200]}; the file is corrupt or not a "
                            "weights-only checkpoint") from exc


# ---------------------------------------------------------------- runs


def versions() -> dict[str, str]:
    """Versions of what shaped the artifacts; recorded in the manifest and the report."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "torchvision", "onnx", "onnxruntime", "pipeline"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


@dataclass
class Run:
    """One run folder and its manifest; every stage of a chain works on the same Run."""

    artifacts_dir: Path
    name: str

    @property
    def root(self) -> Path:
        return self.artifacts_dir / "runs" / self.name

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def manifest(self) -> dict:
        try:
            return json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            raise UsageError(f"run {self.name!r} has no manifest.json; it was not made by "
                             "'pipeline train'") from None
        except json.JSONDecodeError as exc:
            raise PipelineError(f"{self.manifest_path} is not valid JSON ({exc.msg}); restore it "
                                "or start a new run with 'pipeline train'") from None

    def artifacts(self) -> dict[str, dict]:
        return self.manifest()["artifacts"]

    def register(self, name: str, path: Path, *, kind: str, stage: str, parent: str | None = None,
                 config: dict | None = None, **extra: Any) -> dict:
        """List a written file in manifest.json with its sha256 and size."""
        path = Path(path)
        entry = {
            "kind": kind,
            "path": path.relative_to(self.root).as_posix(),
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "stage": stage,
            "parent": parent,
            "config": config or {},
            **extra,
        }
        manifest = self.manifest()
        manifest["artifacts"][name] = entry
        atomic_write_json(self.manifest_path, manifest)
        return entry

    def register_alias(self, alias: str, of: str) -> None:
        """A second name for a listed file (checkpoint-last), without hashing it again."""
        manifest = self.manifest()
        entry = manifest["artifacts"][of]
        manifest["artifacts"][alias] = {k: v for k, v in entry.items() if k not in ("step",)} | {
            "kind": f"{entry['kind']}-alias", "alias_of": of}
        atomic_write_json(self.manifest_path, manifest)

    def unregister(self, name: str) -> None:
        """Drop an artifact from the manifest first, then its file: a crash in between leaves a
        stray file, never a listed file that is missing."""
        manifest = self.manifest()
        entry = manifest["artifacts"].pop(name, None)
        if entry is None:
            return
        atomic_write_json(self.manifest_path, manifest)
        still_used = {e["path"] for e in manifest["artifacts"].values()}
        if entry["path"] not in still_used:
            (self.root / entry["path"]).unlink(missing_ok=True)

    def entry(self, name: str) -> dict:
        artifacts = self.artifacts()
        if name not in artifacts:
            raise UsageError(f"run {self.name!r} has no {name!r}; it has: "
                             f"{', '.join(artifacts) or 'nothing'}")
        return artifacts[name]

    def verified_path(self, name: str) -> Path:
        """The file of artifact ``name`` after checking that it is the file the manifest lists."""
        entry = self.entry(name)
        path = self.root / entry["path"]
        if not path.is_file():
            raise PipelineError(f"{name}: {path} is missing; re-run the stage that writes it")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise PipelineError(f"{name}: {path} does not match its sha256 in manifest.json "
                                "(truncated or changed since it was written); re-run the stage "
                                "that writes it")
        return path

    def mark_stage(self, stage: str, status: str, detail: str | None = None) -> None:
        """running -> complete (or failed): a run is complete only where its manifest says so."""
        manifest = self.manifest()
        stages = manifest.setdefault("stages", {})
        stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        stages[stage] = stages.get(stage, {}) | {"status": status, status: stamp}
        if detail:
            stages[stage]["error"] = detail
        atomic_write_json(self.manifest_path, manifest)

    def record_config(self, stage: str, config: dict) -> None:
        path = self.root / "config.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[stage] = config
        atomic_write_json(path, data)


def _runs_dir(artifacts_dir: Path) -> Path:
    return Path(artifacts_dir) / "runs"


def list_runs(artifacts_dir: Path) -> list[str]:
    folder = _runs_dir(artifacts_dir)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "manifest.json").is_file())


def create_run(artifacts_dir: Path, name: str | None = None) -> Run:
    """Make a new run folder with an empty manifest and point ``latest`` at it."""
    artifacts_dir = Path(artifacts_dir)
    explicit = name is not None
    if name is None:
        name = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if not RUN_NAME.match(name):
        raise UsageError(f"run name {name!r} is not allowed; use letters, digits, '.', '_' and '-'")
    run = Run(artifacts_dir, name)
    try:
        _runs_dir(artifacts_dir).mkdir(parents=True, exist_ok=True)
        for attempt in range(1, 1000):
            try:
                run.root.mkdir()  # exclusive: two processes cannot both make one folder
                break
            except FileExistsError:
                if explicit:
                    raise UsageError(f"run {name!r} already exists in {artifacts_dir}; choose "
                                     "another --run name or leave it out for a new run") from None
                # Two runs started in the same second: the second one gets a suffix.
                run = Run(artifacts_dir, f"{name}-{attempt + 1}")
    except OSError as exc:
        raise PipelineError(f"cannot create a run folder under {artifacts_dir}: {exc.strerror}; "
                            "choose a writable --artifacts-dir") from None
    atomic_write_json(run.manifest_path, {
        "run": run.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "stages": {},
        "artifacts": {},
    })
    atomic_write_text(artifacts_dir / "latest", run.name + "\n")
    return run


def open_run(artifacts_dir: Path, name: str | None = None) -> Run:
    """The named run, or the latest one; a missing run is a usage error listing those that exist."""
    artifacts_dir = Path(artifacts_dir)
    known = list_runs(artifacts_dir)
    if name is None:
        latest = artifacts_dir / "latest"
        if not latest.is_file():
            raise UsageError(f"no run in {artifacts_dir}; start one with 'pipeline train'")
        name = latest.read_text().strip()
    if name not in known:
        raise UsageError(f"run {name!r} does not exist in {artifacts_dir}; existing runs: "
                         f"{', '.join(known) or 'none (start one with pipeline train)'}")
    return Run(artifacts_dir, name)

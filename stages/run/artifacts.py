"""The run folder: its manifest.json, with the sha256 of every artifact, and finding runs.

A stage reads only what the manifest lists and checks its sha256 first, so a file that was
truncated, bit-flipped or swapped after it was written is caught by name before it is used.
Files are written by stages/run/files.py, loaded by stages/run/loading.py; one process at a
time holds a run (stages/run/lock.py).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from stages.run.errors import PipelineError, UsageError
from stages.run.files import atomic_write_json, atomic_write_text, sha256_file

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # fullmatch: '$' lets a '\n' end it


def versions() -> dict[str, str]:
    """Versions of what shaped the artifacts; recorded in the manifest and the report."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "torchvision", "torchao", "onnx", "onnxruntime", "openvino", "nncf",
                    "pipeline"):
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
    folder: Path | None = None  # a run folder kept outside <artifacts_dir>/runs (pipeline.load)

    @property
    def root(self) -> Path:
        return self.folder if self.folder is not None else self.artifacts_dir / "runs" / self.name

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def manifest(self) -> dict:
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            raise UsageError(f"run {self.name!r} has no manifest.json; it was not made by "
                             "'pipeline train'") from None
        except json.JSONDecodeError as exc:
            raise PipelineError(f"{self.manifest_path} is not valid JSON ({exc.msg}); restore it "
                                "or start a new run with 'pipeline train'") from None
        problem = manifest_problem(manifest)
        if problem:
            raise PipelineError(f"{self.manifest_path} is not a run's manifest ({problem}); "
                                "restore it or start a new run with 'pipeline train'")
        return manifest

    def artifacts(self) -> dict[str, dict]:
        return self.manifest()["artifacts"]

    def _write_manifest(self, manifest: dict) -> None:
        """Atomically, padded with spaces (valid JSON) so that a later status change can be
        written over the same bytes when the disk has no room for a new file."""
        text = json.dumps(manifest, indent=2) + "\n"
        atomic_write_text(self.manifest_path, text.ljust(-(-(len(text) + 1024) // 4096) * 4096))

    def path_inside(self, relative: str, name: str) -> Path:
        """The path of a manifest entry, refused unless it stays inside the run folder: a
        manifest is data, and an edited one must not make a stage read or delete elsewhere."""
        pure = PurePosixPath(relative) if isinstance(relative, str) else None
        if pure is None or not relative or pure.is_absolute() or ".." in pure.parts:
            raise PipelineError(f"manifest.json of run {self.name!r}: entry {name!r} points "
                                f"outside the run folder ({relative!r}); refusing to use it: "
                                "restore manifest.json or re-run the stage that wrote it")
        path = self.root / pure
        root = self.root.resolve()
        if root != path.resolve() and root not in path.resolve().parents:
            raise PipelineError(f"manifest.json of run {self.name!r}: entry {name!r} ({relative}) "
                                "is a link that leaves the run folder; refusing to use it: "
                                "replace it with the file itself")
        return path

    def _file_record(self, path: Path) -> dict:
        return {"path": Path(path).relative_to(self.root).as_posix(),
                "sha256": sha256_file(path), "bytes": Path(path).stat().st_size}

    def register(self, name: str, path: Path, *, kind: str, stage: str, parent: str | None = None,
                 config: dict | None = None, companions: tuple[Path, ...] = (),
                 **extra: Any) -> dict:
        """List a written file in manifest.json with its sha256 and size; ``companions`` are
        files that belong to it (OpenVINO's .bin beside its .xml), listed and checked alike."""
        entry = {"kind": kind, **self._file_record(Path(path)), "stage": stage, "parent": parent,
                 "config": config or {}, **extra}
        if companions:
            entry["files"] = [self._file_record(Path(c)) for c in companions]
        manifest = self.manifest()
        manifest["artifacts"][name] = entry
        self._write_manifest(manifest)
        return entry

    def register_alias(self, alias: str, of: str) -> None:
        """A second name for a listed file (checkpoint-last), without hashing it again."""
        manifest = self.manifest()
        entry = manifest["artifacts"][of]
        manifest["artifacts"][alias] = {k: v for k, v in entry.items() if k not in ("step",)} | {
            "kind": f"{entry['kind']}-alias", "alias_of": of}
        self._write_manifest(manifest)

    def unregister(self, name: str) -> None:
        """Drop an artifact from the manifest first, then its files: a crash in between leaves
        a stray file, never a listed file that is missing."""
        manifest = self.manifest()
        entry = manifest["artifacts"].pop(name, None)
        if entry is None:
            return
        self._write_manifest(manifest)
        still_used = {record["path"] for e in manifest["artifacts"].values()
                      for record in [e, *e.get("files", [])]}
        for record in [entry, *entry.get("files", [])]:
            if record["path"] in still_used:
                continue
            try:
                self.path_inside(record["path"], name).unlink(missing_ok=True)
            except PipelineError:  # an edited entry: drop it, but delete nothing outside
                pass

    def entry(self, name: str) -> dict:
        artifacts = self.artifacts()
        if name not in artifacts:
            raise UsageError(f"run {self.name!r} has no {name!r}; it has: "
                             f"{', '.join(artifacts) or 'nothing'}")
        return artifacts[name]

    def verified_path(self, name: str) -> Path:
        """The file of artifact ``name`` after checking that it, and every companion file, is
        the file the manifest lists."""
        entry = self.entry(name)
        for record in [entry, *entry.get("files", [])]:
            path = self.path_inside(record["path"], name)
            if not path.is_file():
                raise PipelineError(f"{name}: {path} is missing; re-run the stage that writes it")
            if path.stat().st_size != record["bytes"] or sha256_file(path) != record["sha256"]:
                raise PipelineError(f"{name}: {path} does not match its sha256 in manifest.json "
                                    "(truncated or changed since it was written); re-run the "
                                    "stage that writes it")
        return self.path_inside(entry["path"], name)

    def shipped_bytes(self, name: str) -> int:
        """Bytes a user ships for a variant: its file and every companion."""
        entry = self.entry(name)
        return entry["bytes"] + sum(record["bytes"] for record in entry.get("files", []))

    def mark_stage(self, stage: str, status: str, detail: str | None = None,
                   seconds: float | None = None) -> None:
        """running -> complete (or failed): a run is complete only where its manifest says so.

        When the disk is full a failure cannot be written as a new file; it is then written
        over the manifest's own bytes (their padding leaves room), so the stage never stays
        `running` after it failed."""
        manifest = self.manifest()
        stages = manifest.setdefault("stages", {})
        stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        stages[stage] = stages.get(stage, {}) | {"status": status, status: stamp}
        if status != "failed":  # an earlier attempt's error no longer describes the stage
            stages[stage].pop("error", None)
        if detail:
            stages[stage]["error"] = detail
        if seconds is not None:
            stages[stage]["seconds"] = seconds
        try:
            self._write_manifest(manifest)
        except PipelineError:
            if status != "failed" or not _overwrite_in_place(self.manifest_path,
                                                             json.dumps(manifest, indent=2)):
                raise

    def record_config(self, stage: str, config: dict) -> None:
        path = self.root / "config.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[stage] = config
        atomic_write_json(path, data)

    def recorded_config(self, stage: str) -> dict:
        """The configuration a stage last ran with ({} if it never ran)."""
        try:
            return json.loads((self.root / "config.json").read_text()).get(stage, {})
        except (OSError, json.JSONDecodeError):
            return {}


def manifest_problem(manifest: Any) -> str | None:
    """What makes parsed JSON not a manifest, in words; None if it is one. Every reader then
    indexes it freely: a `{}`, a `[]` or an entry without its sha256 would otherwise end in a
    raw KeyError or TypeError far from the file that caused it."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    if not isinstance(manifest.get("artifacts"), dict):
        return "it has no 'artifacts' object"
    if not isinstance(manifest.get("stages", {}), dict) or not all(
            isinstance(s, dict) for s in manifest.get("stages", {}).values()):
        return "its 'stages' are not objects"
    for name, entry in manifest["artifacts"].items():
        records = [entry, *entry.get("files", [])] if isinstance(entry, dict) else [entry]
        for record in records:
            if not isinstance(record, dict) or not isinstance(record.get("path"), str) or not (
                    isinstance(record.get("sha256"), str)) or type(record.get("bytes")) is not int:
                return f"entry {name!r} lacks its path, sha256 or bytes"
    return None


def _overwrite_in_place(path: Path, text: str) -> bool:
    """Write ``text`` over the existing bytes of ``path``, padded to its length; False if it
    does not fit. Needs no new disk blocks, so it works on a full disk."""
    data = text.encode()
    try:
        size = path.stat().st_size
        if len(data) > size:
            return False
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data.ljust(size, b" "))
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def _runs_dir(artifacts_dir: Path) -> Path:
    return Path(artifacts_dir) / "runs"


def list_runs(artifacts_dir: Path) -> list[str]:
    folder = _runs_dir(artifacts_dir)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "manifest.json").is_file())


def timestamp_name() -> str:
    """A new run's default name: the local time to the second."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def create_run(artifacts_dir: Path, name: str | None = None) -> Run:
    """Make a new run folder with an empty manifest and point ``latest`` at it."""
    artifacts_dir = Path(artifacts_dir)
    explicit = name is not None
    if name is None:
        name = timestamp_name()
    if not RUN_NAME.fullmatch(name):
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
    run._write_manifest({
        "run": run.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "stages": {},
        "artifacts": {},
    })
    atomic_write_text(artifacts_dir / "latest", run.name + "\n")
    return run


def open_run(artifacts_dir: Path, name: str | None = None) -> Run:
    """The named run, a run folder's path, or the latest run; a missing run is a usage error
    listing those that exist."""
    artifacts_dir = Path(artifacts_dir)
    known = list_runs(artifacts_dir)
    existing = ', '.join(known) or 'none (start one with pipeline train)'
    if name is not None and name not in known and _looks_like_a_path(name):
        return run_at(Path(name))
    if name is None:
        latest = artifacts_dir / "latest"
        if not latest.is_file():
            if known:  # runs copied in, or the pointer deleted: say which there are
                raise UsageError(f"{artifacts_dir} has no 'latest' pointer, so no run is the "
                                 f"latest; pass --run NAME (existing runs: {existing})")
            raise UsageError(f"no run in {artifacts_dir}; start one with 'pipeline train'")
        name = latest.read_text().strip()
        if name not in known:
            raise UsageError(f"{latest} names run {name!r}, which is not in {artifacts_dir}; "
                             f"pass --run NAME (existing runs: {existing})")
    if name not in known:
        raise UsageError(f"run {name!r} does not exist in {artifacts_dir}; existing runs: "
                         f"{existing}")
    return Run(artifacts_dir, name)


def _looks_like_a_path(name: str) -> bool:
    if "/" in name or os.sep in name or name in (".", ".."):
        return True
    try:
        return (Path(name) / "manifest.json").is_file()
    except OSError:  # a name too long for a file name: a run name that does not exist
        return False


def run_at(folder: Path) -> Run:
    """The run in ``folder``, wherever it is: in an artifacts folder's runs/ (whose `latest`
    it then shares) or copied anywhere."""
    folder = Path(os.path.abspath(Path(folder).expanduser()))  # '..' resolved: a run's name
    if not (folder / "manifest.json").is_file():
        raise UsageError(f"{folder} is not a run folder (it has no manifest.json); give a run's "
                         "name or the path of its folder")
    if folder.parent.name == "runs":
        return Run(folder.parent.parent, folder.name)
    return Run(folder.parent, folder.name, folder)

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
import resource
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

from stages.run import signals
from stages.run.errors import PipelineError, UsageError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
TEMP_SUFFIX = ".tmp"
# Errors of the disk rather than of the code: full, quota, file size limit, read-only, I/O.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES,
                errno.EPERM}
# Left free beyond a write's own estimate, so that the manifest and the report still fit.
SPARE_BYTES = 16 << 20


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


def _umask() -> int:
    """The process umask (read by setting it, so set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# What writers that swallow the OSError say when the system took fewer bytes than asked.
SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|\d+ requested and \d+ written")


def _write_failure(exc: BaseException) -> OSError | None:
    """The operating-system error behind a failed write, if there is one. Tools that write files
    themselves wrap it: torch's zip writer raises "unexpected pos" with the OSError as context;
    some keep only a short-write message, which stands for EIO here."""
    seen, short = set(), False
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            return exc
        short = short or bool(SHORT_WRITE.search(str(exc)))
        exc = exc.__cause__ or exc.__context__
    if short:
        return OSError(errno.EIO, "the system accepted fewer bytes than were written (a full "
                                  "disk or a file size limit)")
    return None


def raise_if_disk_failure(exc: BaseException, path: Path) -> None:
    """For a tool's own error: if a write at the operating system is behind it, say so."""
    failure = _write_failure(exc)
    if failure is not None:
        raise PipelineError(disk_failure_message(path, failure)) from None


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.2f} MB" if count < 10e6 else f"{count / 1e6:.0f} MB"


def disk_failure_message(path: Path, error: OSError | None, written: int | None = None) -> str:
    """Say what failed at the disk and what to do: the folder, what is free, what was needed."""
    folder = Path(path).parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    reason = error.strerror if error is not None and error.strerror else "the write failed"
    parts = [f"writing {path} failed: {reason}"]
    if error is not None and error.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            parts.append(f"the file size limit of this process is {_megabytes(limit)} "
                         "(ulimit -f)")
    if written:
        parts.append(f"{_megabytes(written)} were written before it failed")
    if free is not None:
        parts.append(f"{_megabytes(free)} free in {folder}")
    return ("; ".join(parts) + "; nothing was written under that name: free some space, raise "
            "the limit or choose another --artifacts-dir")


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse a large write up front when the disk plainly cannot hold it."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < needed + SPARE_BYTES:
        raise PipelineError(f"not enough space in {folder} for {what}: {_megabytes(free)} free, "
                            f"it needs about {_megabytes(needed)} (plus "
                            f"{_megabytes(SPARE_BYTES)} kept spare); free some space or choose "
                            "another --artifacts-dir")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    Tools that insist on writing a file themselves (torch.onnx, ONNX Runtime's quantizer) write
    to the temporary path, so a crash never leaves a half file under the real name. The file
    gets the permissions the umask gives a normal write (mkstemp's are private).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX,
                                        dir=path.parent)
        os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise PipelineError(disk_failure_message(path, exc)) from None
        raise PipelineError(f"cannot write in {path.parent}: {exc.strerror}; choose a writable "
                            "--artifacts-dir") from None
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except Exception as exc:
        stopped = _stop_behind(exc)
        if stopped is not None:  # Ctrl-C or SIGTERM inside a tool's writer, which wrapped it
            raise stopped from None
        failure = _write_failure(exc)
        if failure is None:
            raise
        written = tmp.stat().st_size if tmp.exists() else None
        raise PipelineError(disk_failure_message(path, failure, written)) from None
    finally:
        tmp.unlink(missing_ok=True)


def _stop_behind(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit a tool's error was raised over, if any. A signal
    that interrupts a write system call runs its Python handler inside the write; torch's zip
    writer then reports the handler's SystemExit as RuntimeError "unexpected pos 46 vs 0",
    which reads as a short write, so a SIGTERM ended as a disk failure, exit 1 (as it once did
    in CI, where the test expected 143)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def remove_stale_temporaries(folder: Path) -> int:
    """Delete temporary files a killed process left behind (never a file under a real name)."""
    removed = 0
    for stale in Path(folder).glob(f".*{TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Call ``write(file)`` on a temporary file and rename it to ``path`` once it is on disk.
    Ctrl-C and SIGTERM wait for it (a checkpoint takes moments), so an interrupted run keeps
    the file it was writing; tools that write for minutes (exporters) use atomic_path alone."""
    with signals.deferred(signal.SIGINT, signal.SIGTERM), atomic_path(path) as tmp:
        with open(tmp, mode) as f:
            write(f)
            f.flush()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested structure: about what torch.save writes."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    check_free_space(Path(path).parent, tensor_bytes(obj), Path(path).name)
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
            # and pickles of other protocols are noted; neither says anything about this file.
            warnings.filterwarnings("ignore", category=UserWarning,
                                    module=r"torch\.(_utils|_weights_only_unpickler)")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise PipelineError(load_failure(Path(path), exc)) from exc


PICKLE_START = 0x80  # the PROTO opcode every pickle of protocol 2 or later begins with
ZIP_START = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6


def load_failure(path: Path, exc: BaseException) -> str:
    """Why a weights-only load failed, in our words: what the file is not, or that it was
    refused because loading it would run code (never PyTorch's advice to load it anyway)."""
    import re

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
    named = re.findall(r"GLOBAL ([\w.]+)", text)
    if "Weights only load failed" in text:
        what = f" (it names {named[0]}, not only tensors)" if named else ""
        return (f"{path} was refused: loading it would run code from the file{what}; save the "
                "weights alone (torch.save(model.state_dict(), path)) and give that file")
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    return f"cannot load {path}: {first}; the file is truncated or corrupt"


# ---------------------------------------------------------------- runs


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
    run._write_manifest({
        "run": run.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "stages": {},
        "artifacts": {},
    })
    atomic_write_text(artifacts_dir / "latest", run.name + "\n")
    return run


LOCK_NAME = ".lock"


@contextlib.contextmanager
def hold_run(run: Run, doing: str) -> Iterator[None]:
    """Hold the run for one process while it works on it. Two processes on one run would each
    read the manifest, add their own entries and write it back: the later write would drop
    what the other registered. An advisory lock (flock) on the run's .lock file, which the
    kernel releases when the process ends however it ends: a killed run never leaves it held.
    Under torchrun rank 0 holds it for every rank."""
    import fcntl

    path = run.root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PipelineError(f"cannot write in run folder {run.root}: {exc.strerror}; check its "
                            "permissions or choose another --artifacts-dir") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
            raise UsageError(f"run {run.name!r} is in use by another pipeline process "
                             f"({holder}); wait for it to end, or give another --run") from None
        try:  # who holds it, for that message; a full disk must not stop the run for it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}: {doing}".encode(), 0)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


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
    return "/" in name or os.sep in name or name in (".", "..") or (
        Path(name) / "manifest.json").is_file()


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

"""Files in the run folder: atomic writes, what a failed write says, and sha256.

A file is written to a temporary name beside its own, flushed, fsynced and renamed, so a crash
or a full disk never leaves a half file under the real name; a disk failure is said in words
(the folder, what is free, what was needed) rather than as a tool's traceback.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from stages.run import signals
from stages.run.errors import NotMade, PipelineError

TEMP_SUFFIX = ".tmp"
# Errors of the disk rather than of the code: full, quota, file size limit, read-only, I/O.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES,
                errno.EPERM}
# Left free beyond a write's own estimate, so that the manifest and the report still fit.
SPARE_BYTES = 16 << 20


def fsync_folder(folder: Path, files: bool = True) -> None:
    """``folder`` on disk, and with ``files`` every file in it: what is written as a whole
    folder (an export) and then moved into place, so that a power cut after it was said to be
    done leaves no empty files."""
    if files:
        for path in folder.iterdir():
            if path.is_file() and not path.is_symlink():
                with open(path, "rb") as file:
                    os.fsync(file.fileno())
    _fsync_dir(folder)


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


@contextlib.contextmanager
def converter_errors(converter: str, path: Path | None = None) -> Iterator[None]:
    """What a converter or runtime raises of its own while it makes a variant (its own types,
    a RuntimeError from native code) as NotMade: it cannot take this model, which costs the
    variant and what is made from it, not the stage. Ours (a full disk, a refused file) and a
    write the operating system refused (on ``path``'s disk, else the temporary folder's, where
    Inductor and the exporters keep their files) stay the stage's. Wrap the runtime's own
    calls alone: our code's errors inside would read as the model's."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as exc:
        raise_if_disk_failure(exc, path or Path(tempfile.gettempdir()) / converter)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise NotMade(f"{converter} failed: {first}") from exc


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

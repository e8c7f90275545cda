"""The lock: one pipeline process at a time works on a run."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from stages.run.artifacts import Run
from stages.run.errors import PipelineError, UsageError

LOCK_NAME = ".lock"


@contextlib.contextmanager
def hold_run(run: Run, doing: str) -> Iterator[None]:
    """Hold the run for one process while it works on it. Two processes on one run would each
    read the manifest, add their own entries and write it back: the later write would drop
    what the other registered. An advisory lock (flock) on the run's .lock file, which the
    kernel releases when the process ends however it ends: a killed run never leaves it held.
    Under torchrun rank 0 holds it for every rank."""
    import fcntl

    leaving = links_out(run)
    if leaving:  # a run folder copied in is data: a link in it must not take our writes out
        raise PipelineError(f"run folder {run.root} holds a link that leads out of it "
                            f"({', '.join(leaving)}); a stage would write where it points: "
                            "replace it with a file or folder of its own")
    path = run.root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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


def links_out(run: Run) -> list[str]:
    """The run folder's entries, and its stage folders' (train/amp, report/), that are links
    leading out of it: the lock file is written in place, and a stage writes into its folder."""
    root = run.root.resolve()
    folders = [run.root, *(p for p in run.root.iterdir() if p.is_dir() and not p.is_symlink())]
    return sorted(entry.relative_to(run.root).as_posix() for folder in folders
                  for entry in folder.iterdir() if entry.is_symlink()
                  and root not in entry.resolve().parents)

"""The lock: one pipeline process at a time works on a run."""
from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator

from stages.run.artifacts import Run
from stages.run.errors import PipelineError, UsageError

LOCK_NAME = ".lock"
# The lock's descriptors this process holds. flock belongs to the open file, which a forked
# child (a DataLoader worker) shares: a holder killed with SIGKILL left the run locked until its
# workers exited too. A forked child closes its copies at once.
_HELD: set[int] = set()


def _close_in_forked_child() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


@contextlib.contextmanager
def hold_run(run: Run, doing: str) -> Iterator[None]:
    """Hold the run for one process while it works on it. Two processes on one run would each
    read the manifest, add their own entries and write it back: the later write would drop
    what the other registered. An advisory lock (flock) on the run's .lock file, which the
    kernel releases when the process ends however it ends: a killed run never leaves it held.
    Under torchrun rank 0 holds it for every rank."""
    import fcntl

    path = run.root / LOCK_NAME
    try:  # written in place (the holder's pid): not through a link a copied run folder holds
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            raise PipelineError(f"{path} is a link; the lock is written in place, so remove "
                                "it (a run folder's .lock is its own file)") from None
        raise PipelineError(f"cannot write in run folder {run.root}: {exc.strerror}; check its "
                            "permissions or choose another --artifacts-dir") from None
    if os.fstat(fd).st_nlink > 1:  # a hard link: another name for someone's file
        os.close(fd)
        raise PipelineError(f"{path} has another name (a hard link); the lock is written in "
                            "place, so remove it (a run folder's .lock is its own file)")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
            raise UsageError(f"run {run.name!r} is in use by another pipeline process "
                             f"({holder}); wait for it to end, or give another --run") from None
        _HELD.add(fd)
        try:  # who holds it, for that message; a full disk must not stop the run for it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}: {doing}".encode(), 0)
        except OSError:
            pass
        yield
    finally:
        _HELD.discard(fd)
        os.close(fd)  # releases the lock


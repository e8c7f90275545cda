"""Run a function in a fresh process, so that a runtime's native crash (a SIGSEGV in a kernel,
an abort) ends that process and not the stage, and so that the function runs with the
instruction set a deployment gets rather than this process's (bf16 training on an AMX CPU caps
oneDNN for the process that trains: stages/training/precision.py).

The child is spawned, not forked: a fork of a process whose OpenMP and oneTBB pools have run
can hang in them. It is kept for the next call with the same environment and working folder
(`_Worker`). It says what it is doing through a small shared buffer (`Doing`), which survives
its death, so that the parent can name what crashed and go on without it.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import pickle
import signal
import threading
from typing import Any

# Set beside ONEDNN_MAX_CPU_ISA by the one place that caps it for training
# (stages/training/precision.py), so that a child can be given the ISA a deployment gets
# while a cap the user set stays theirs.
CAPPED_FOR_TRAINING = "PIPELINE_ONEDNN_CAPPED_FOR_TRAINING"
DOING_BYTES = 512


class Crashed(Exception):
    """The child died of a signal (or exited without a result) while doing ``doing``;
    ``peak_rss_bytes``: the most memory it was seen holding (a SIGKILL is most often the
    kernel's out-of-memory killer)."""

    def __init__(self, signal_name: str, doing: str, peak_rss_bytes: int = 0):
        super().__init__(f"{signal_name} while {doing or 'starting'}")
        self.signal_name, self.doing = signal_name, doing
        self.peak_rss_bytes = peak_rss_bytes


class Doing:
    """What the child is doing, in a buffer the parent reads after the child died. A write
    is a copy into shared memory, no system call, so it can sit inside a timing loop."""

    def __init__(self, buffer=None):
        self.buffer = buffer

    def __call__(self, text: str) -> None:
        if self.buffer is not None:
            self.buffer.value = text.encode()[:DOING_BYTES - 1]

    def read(self) -> str:
        return self.buffer.value.decode(errors="replace") if self.buffer is not None else ""


def deployment_environment() -> dict[str, str]:
    """This process's environment less the oneDNN cap training set (a user's own cap stays)."""
    environment = dict(os.environ)
    capped = environment.pop(CAPPED_FOR_TRAINING, None)
    if capped is not None and environment.get("ONEDNN_MAX_CPU_ISA") == capped:
        del environment["ONEDNN_MAX_CPU_ISA"]
    return environment


def signal_name(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class _Worker:
    """A spawned child that runs one call after another while this process lives: a process
    that reports more than once (a notebook, the test suite) skips the child's start, about
    3 s of imports each, and keeps Inductor's in-memory caches (the fast tests took 4 min 40 s
    instead of 5 min 23 s on a 2-core Zen 4 EPYC). One at a time, for one environment and
    working folder (a user's model module is imported relative to it); a crash ends it, and
    the next call starts another."""

    def __init__(self, key: tuple):
        context = multiprocessing.get_context("spawn")
        self.key, self.buffer = key, context.RawArray("c", DOING_BYTES)
        self.answers, answer = context.Pipe(duplex=False)
        request, self.requests = context.Pipe(duplex=False)
        # Not a daemon: a daemonic process may not start processes of its own (Inductor's
        # compile workers may); stop() ends it, at this process's exit too.
        # The kernel's signal at the parent's death comes when the thread that started the
        # child ends: from any thread but the main one, that is not the parent's death.
        watched = os.getpid() if threading.current_thread() is threading.main_thread() else None
        self.process = context.Process(target=_serve, args=(request, answer, self.buffer,
                                                            watched))
        with _environment(dict(key[0])):
            self.process.start()
        request.close()
        answer.close()

    def stop(self) -> None:
        try:
            self.requests.send(None)
        except OSError:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


_worker: _Worker | None = None


def call(target: str, *args: Any, environment: dict[str, str] | None = None) -> Any:
    """``target`` ("package.module:function") called with ``Doing`` then ``args`` in a spawned
    child with ``environment`` (default: the deployment's); returns what it returns, raises
    what it raises (or RuntimeError where that cannot be pickled), and raises Crashed where it
    dies without an answer."""
    global _worker
    key = (frozenset((deployment_environment() if environment is None
                      else environment).items()), os.getcwd())
    if _worker is not None and (_worker.key != key or not _worker.process.is_alive()):
        _worker.stop()
        _worker = None
    if _worker is None:
        _worker = _Worker(key)
        # Registered after multiprocessing's own exit handler (made when the first child
        # started), so that it runs first: that one joins every child still running.
        atexit.unregister(release)
        atexit.register(release)
    worker = _worker
    Doing(worker.buffer)("")
    peak = [0]
    try:
        worker.requests.send((target, args))
        answer = _answer(worker.answers, worker.process, peak)
    except BaseException:  # Ctrl-C or a kill of this process: the child goes too, at once
        worker.process.terminate()
        worker.process.join()
        _worker = None
        raise
    if answer is None:
        worker.process.join()
        _worker = None
        raise Crashed(signal_name(worker.process.exitcode), Doing(worker.buffer).read(),
                      peak[0])
    ok, value = answer
    if ok:
        return value
    raise value


def release() -> None:
    """End the kept child, so that the next call starts a fresh process (after quantize, the
    report's measuring child does not inherit its memory)."""
    global _worker
    if _worker is not None:
        _worker.stop()
        _worker = None


def _answer(receive, child, peak: list[int]):
    """The child's (ok, value), or None where it died without sending one; ``peak[0]`` the
    most memory it was seen holding, read every 0.2 s."""
    while True:
        peak[0] = max(peak[0], _resident_bytes(child.pid))
        if receive.poll(0.2):
            try:
                return receive.recv()
            except EOFError:
                return None
        if not child.is_alive() and not receive.poll(0):
            return None


def _resident_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (Linux's /proc), 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _environment(wanted: dict[str, str]):
    """os.environ as ``wanted`` while a child starts (spawn passes the current one on)."""
    import contextlib

    @contextlib.contextmanager
    def swapped():
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(wanted)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

    return swapped()


def _serve(requests, answers, buffer, parent: int | None) -> None:
    """The child's loop: each request's (ok, value) sent back, until the parent says stop or
    goes."""
    # Ctrl-C reaches the whole process group: an idle child (the report's, while predict runs
    # after it in a chain) printed KeyboardInterrupt's traceback beside the parent's one line.
    # Ignored while idle only (processes started from a call inherit no SIG_IGN), from before
    # each answer is sent; the parent ends a child at work itself (call) when it is interrupted.
    if parent is not None:
        _end_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            request = requests.recv()
        except EOFError:
            return
        if request is None:
            return
        target, args = request
        signal.signal(signal.SIGINT, signal.default_int_handler)
        result = _result(target, buffer, args)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            answers.send(result)
        except Exception as exc:  # an exception (or result) that cannot be pickled
            answers.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}"
                                              if not result[0] else f"unpicklable result: {exc}")))


def _end_with(parent: int) -> None:
    """Have the kernel kill this child when ``parent`` ends, a SIGKILL included (Linux's
    PR_SET_PDEATHSIG): the child holds no lock on the run, and left running after its parent
    was killed it went on writing the run's manifest beside the next process to take the lock.
    Elsewhere the child still ends at its next answer, on the closed pipe."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request above was made
        os._exit(1)


def _result(target: str, buffer, args: tuple) -> tuple[bool, Any]:
    module, _, name = target.partition(":")
    try:
        return True, getattr(importlib.import_module(module), name)(Doing(buffer), *args)
    except BaseException as exc:  # noqa: BLE001  every failure goes back to the parent
        import traceback

        exc.add_note(f"in the child process {target}:\n{traceback.format_exc()}")  # --debug
        try:  # one that pickles but cannot be rebuilt (its __init__ takes other arguments)
            rebuild, arguments = exc.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[:2]
            rebuild(*arguments)  # as unpickling in the parent does: it had raised TypeError
        except Exception:  # noqa: BLE001  sent as its type, message and trace instead
            stand_in = RuntimeError(f"{type(exc).__name__}: {exc}")
            stand_in.__notes__ = exc.__notes__
            return False, stand_in
        return False, exc

"""Run a function in a fresh process, so that a runtime's native crash (a SIGSEGV in a kernel,
an abort) ends that process and not the stage, and so that the function runs with the
instruction set a deployment gets rather than this process's (bf16 training on an AMX CPU caps
oneDNN for the process that trains: stages/training/precision.py).

The child is spawned, not forked: a fork of a process whose OpenMP and oneTBB pools have run
can hang in them. It says what it is doing through a small shared buffer (`Doing`), which
survives its death, so that the parent can name what crashed and go on without it.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
from typing import Any

# Set beside ONEDNN_MAX_CPU_ISA by the one place that caps it for training
# (stages/training/precision.py), so that a child can be given the ISA a deployment gets
# while a cap the user set stays theirs.
CAPPED_FOR_TRAINING = "PIPELINE_ONEDNN_CAPPED_FOR_TRAINING"
DOING_BYTES = 512


class Crashed(Exception):
    """The child died of a signal (or exited without a result) while doing ``doing``."""

    def __init__(self, signal_name: str, doing: str):
        super().__init__(f"{signal_name} while {doing or 'starting'}")
        self.signal_name, self.doing = signal_name, doing


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


def call(target: str, *args: Any, environment: dict[str, str] | None = None) -> Any:
    """``target`` ("package.module:function") called with ``Doing`` then ``args`` in a spawned
    child with ``environment`` (default: the deployment's); returns what it returns, raises
    what it raises (or RuntimeError where that cannot be pickled), and raises Crashed where it
    dies without an answer."""
    context = multiprocessing.get_context("spawn")
    buffer = context.RawArray("c", DOING_BYTES)
    receive, send = context.Pipe(duplex=False)
    # Not a daemon: a daemonic process may not start processes of its own (Inductor's compile
    # workers may); the parent ends it wherever it stops waiting for it.
    child = context.Process(target=_child, args=(target, send, buffer, *args))
    with _environment(deployment_environment() if environment is None else environment):
        child.start()
    send.close()
    try:
        answer = _answer(receive, child)
    except BaseException:  # Ctrl-C or a kill of this process: the child goes too
        child.terminate()
        child.join()
        raise
    child.join()
    if answer is None:
        raise Crashed(signal_name(child.exitcode), Doing(buffer).read())
    ok, value = answer
    if ok:
        return value
    raise value


def _answer(receive, child):
    """The child's (ok, value), or None where it died without sending one."""
    while True:
        if receive.poll(0.2):
            try:
                return receive.recv()
            except EOFError:
                return None
        if not child.is_alive() and not receive.poll(0):
            return None


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


def _child(target: str, send, buffer, *args) -> None:
    module, _, name = target.partition(":")
    try:
        result = (True, getattr(importlib.import_module(module), name)(Doing(buffer), *args))
    except BaseException as exc:  # noqa: BLE001  every failure goes back to the parent
        import traceback

        exc.add_note(f"in the child process {target}:\n{traceback.format_exc()}")  # --debug
        result = (False, exc)
    try:
        send.send(result)
    except Exception as exc:  # an exception (or result) that cannot be pickled
        send.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}"
                                       if not result[0] else f"unpicklable result: {exc}")))
    send.close()

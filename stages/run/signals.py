"""Signals held back while something must not be cut short: a stage's status being written, a
failed loader's workers being shut down."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred(*numbers: int):
    """Hold the signals ``numbers`` back inside the block and deliver them, once each, to
    their own handlers after it. Their Python handlers raise (KeyboardInterrupt, SystemExit,
    DataLoader's worker check), and one that raises mid-write abandons the write.

    The handlers are swapped, not the signal mask: the mask is per thread, so the kernel hands
    a masked signal to one of torch's other threads, and Python still runs its handler in the
    main thread."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    arrived: list[int] = []
    previous = {}
    try:  # a signal's handler raising mid-swap still has every swapped one put back
        for number in numbers:
            handler = signal.getsignal(number)
            if handler is None:  # installed outside Python: cannot be put back, so left alone
                continue
            previous[number] = handler
            signal.signal(number, lambda signum, frame: arrived.append(signum))
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _deliver(arrived)


def _deliver(arrived: list[int]) -> None:
    """Each held signal once, those that end the process last, so that a handler raising (the
    DataLoader's SIGCHLD check) does not swallow a SIGTERM held beside it; the last exception
    raised is raised."""
    stopping = (signal.SIGINT, signal.SIGTERM)
    raised = None
    for number in sorted(dict.fromkeys(arrived), key=lambda number: number in stopping):
        try:
            signal.raise_signal(number)
        except BaseException as error:  # noqa: BLE001 - raised again below, after the rest
            raised = error
    if raised is not None:
        raise raised

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
    for number in numbers:
        handler = signal.getsignal(number)
        if handler is None:  # installed outside Python: cannot be put back, so left alone
            continue
        previous[number] = handler
        signal.signal(number, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(arrived):
            signal.raise_signal(number)

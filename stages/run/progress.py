"""Progress bars (tqdm) on a terminal, one plain line per event elsewhere, nothing with quiet."""
from __future__ import annotations

import sys
from typing import Iterable


def progress(iterable: Iterable, desc: str, quiet: bool = False, total: int | None = None):
    """A tqdm bar on an interactive stderr; the bare iterable in logs, CI and with --quiet."""
    if quiet or not sys.stderr.isatty():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


def say(message: str, quiet: bool = False) -> None:
    """One line on stderr that does not tear a progress bar."""
    if quiet:
        return
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)

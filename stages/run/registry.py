"""Name -> entry registries filled by a decorator: models, data sets, variants and the
runtimes' loaders all use these two functions, and `pipeline list` prints what they hold."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


def register(registry: dict[str, Any], name: str) -> Callable[[T], T]:
    """Decorator that files an entry (a function, or a record such as a Variant) under
    ``name``; a second entry with one name is a bug, refused where it is made."""

    def add(entry: T) -> T:
        if name in registry:
            raise RuntimeError(f"{name!r} is registered twice")
        registry[name] = entry
        return entry

    return add


def lookup(registry: dict[str, T], name: str, what: str) -> T:
    """The entry for ``name``, or a ValueError that lists every known name."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}") from None

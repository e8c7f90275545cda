"""Name -> function registries filled by a decorator (models, data sets, quantization methods)."""
from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def register(registry: dict[str, Callable], name: str) -> Callable[[F], F]:
    """Decorator that files a function under ``name``; a second entry with one name is a bug."""

    def add(fn: F) -> F:
        if name in registry:
            raise RuntimeError(f"{name!r} is registered twice")
        registry[name] = fn
        return fn

    return add


def lookup(registry: dict[str, Callable], name: str, what: str) -> Callable:
    """The entry for ``name``, or a ValueError that lists every known name."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}") from None

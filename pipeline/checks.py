"""The checks and conversions a stage config's __post_init__ applies to its values, wherever
they come from (flags, a TOML file, Python): types, choices, lower bounds, durations, lists.
Each failure is a ValueError naming the flag, which the CLI turns into a usage error (exit 2).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION_FIELDS = ("tuning_time", "time")  # a TOML file may give these as "5m"


def _fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` has the type a dataclass field declares (a resolved type hint)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if typing.get_origin(kind) is tuple:  # a comma list, or a list of its element type
        element = typing.get_args(kind)[0]
        return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(
            _fits(item, element) for item in value))
    return True


def _wanted(kind: Any) -> str:
    options = [option for option in typing.get_args(kind) if option is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_wanted(option) for option in options)
    if typing.get_origin(kind) is tuple:
        return f"a list of {_wanted(options[0]).removeprefix('a ')}s or a comma list"
    return TYPE_NAMES.get(kind, str(kind))


def type_error(cls, values: dict[str, Any]) -> str | None:
    """The first value whose type its field does not allow, as 'must be expected, got value'."""
    kinds = typing.get_type_hints(cls)
    for name, value in values.items():
        kind = kinds.get(name)
        if kind is not None and not _fits(value, kind):
            without_none = [k for k in typing.get_args(kind) if k is not type(None)]
            return f"must be {_wanted(without_none[0] if len(without_none) == 1 else kind)}, " \
                   f"got {value!r}"
    return None


def check_types(config) -> None:
    """Flags arrive typed by Click; other callers (a TOML file, Python code) may not."""
    for field in dataclasses.fields(config):
        problem = type_error(type(config), {field.name: getattr(config, field.name)})
        if problem:
            raise ValueError(f"--{field.name.replace('_', '-')} {problem}")


def expanded(flag: str, text: str) -> Path:
    """The path with ~ expanded: '~name' of a user this machine does not have is a usage error
    (pathlib raises RuntimeError), not a traceback."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ValueError(f"{flag} {text!r}: '~' names no user or home directory here; give the "
                         "path in full") from None


def choice(flag: str, value: Any, allowed: tuple, optional: bool = False) -> None:
    """``value`` is one of ``allowed`` (or None, where ``optional``: the default in words)."""
    if value not in allowed and not (optional and value is None):
        raise ValueError(f"{flag} {value!r} is not one of: {', '.join(map(str, allowed))}")


def at_least(flag: str, value: float, low: float) -> None:
    if not value >= low:  # also refuses NaN
        raise ValueError(f"{flag} must be at least {low}, got {value}")


# Seeds numpy's and torch's generators take whole: the sampler's seed * 100003 + epoch with them.
MAX_SEED = 2 ** 32 - 1


def seed_field(config) -> None:
    if isinstance(config.seed, int) and not 0 <= config.seed <= MAX_SEED:
        raise ValueError(f"--seed must be from 0 to {MAX_SEED}, got {config.seed}")


def at_most(flag: str, value: float, high: float, why: str = "") -> None:
    if not value <= high:
        raise ValueError(f"{flag} must be at most {high:,}{why}, got {value}")


def within(flag: str, value: float, low: float, high: float, why: str = "") -> None:
    at_least(flag, value, low)
    at_most(flag, value, high, why)


def greater_than(flag: str, value: float, low: float) -> None:
    if not value > low:  # also refuses NaN
        raise ValueError(f"{flag} must be greater than {low}, got {value}")


def learning_rate(value: Any) -> float | str:
    """--lr: a positive number, or "auto" for a range test."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not number > 0 or number == math.inf:
        raise ValueError(f"--lr must be a positive number or auto, got {value!r}")
    return number


def duration_field(config, field: str = "tuning_time") -> None:
    """A duration field (--tuning-time, --time) as seconds: a duration such as '5m' parsed,
    anything else refused."""
    flag, value = f"--{field.replace('_', '-')}", getattr(config, field)
    if isinstance(value, str):
        value = parse_duration(flag, value)
        setattr(config, field, value)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # check_types names the type
    if not value > 0 or value == math.inf:  # inf from a config file (time = inf)
        raise ValueError(f"{flag} must be a positive duration, got {value}")


def parse_duration(flag: str, text: str) -> float:
    """Seconds of '90', '90s', '5m', '1.5h'."""
    cleaned = text.strip().lower()
    unit = DURATION_UNITS.get(cleaned[-1:], None)
    number = cleaned[:-1] if unit else cleaned
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a duration; give one such as 90s, 5m or "
                         "1h") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{flag} {text!r} is not a duration; give one such as 90s, 5m or 1h")
    return seconds


def parse_int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None


def no_choices_under_auto(config) -> None:
    """--auto searches ort-static's calibration, weight scales, types and format itself: one of
    them given beside it had been dropped without a word (a QOperator asked for came out QDQ)."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    given = [flag for flag, name in (
        ("--calibration-method", "calibration_method"), ("--per-channel/--per-tensor",
                                                         "per_channel"),
        ("--ort-types", "ort_types"), ("--ort-format", "ort_format"))
        if getattr(config, name) != defaults[name]]
    if given:
        raise ValueError(f"--auto chooses ort-static's {', '.join(given)} itself; drop "
                         f"{'it' if len(given) == 1 else 'them'} or drop --auto")


def check_compare_runs(config, artifacts_dir: Path) -> None:
    """--compare names runs of artifacts_dir that have a report: checked before any stage of
    the chain starts, not after the report has measured everything."""
    from stages.run.artifacts import list_runs, open_run

    known = list_runs(artifacts_dir)
    missing = [name for name in config.compare or () if name not in known]
    if missing:
        raise ValueError(f"--compare: no run {', '.join(map(repr, missing))} in {artifacts_dir}; "
                         f"existing runs: {', '.join(known) or 'none'}")
    for name in config.compare or ():
        if "report/report.json" not in open_run(artifacts_dir, name).artifacts():
            raise ValueError(f"--compare: run {name!r} has no report yet; run 'pipeline --run "
                             f"{name} report' first")

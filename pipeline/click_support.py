"""The Click pieces the commands of pipeline/cli.py share: the group's handling of failure (one
line on stderr and an exit code), commands whose options may follow their paths, the --run and
--artifacts-dir a stage may carry, each stage's options made from pipeline/flags.py and its
config's dataclass, the --config file's tables, and a stage config built from the flags (a
config that cannot be is a usage error, exit 2).
"""
from __future__ import annotations

import dataclasses
import sys
import tomllib
import typing
from pathlib import Path
from typing import Callable

import click

from pipeline import config as cfg
from pipeline.checks import DURATION_FIELDS, type_error


class PipelineGroup(click.Group):
    """Ends every failure with one line on stderr and an exit code: 2 for usage, 1 at runtime."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        debug = "--debug" in argv
        try:
            code = super().main(argv, prog_name or "pipeline", complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(0)
        except click.ClickException as exc:
            message = exc.format_message()
            if message.startswith("No such command"):
                message += f" Commands: {', '.join(self.list_commands(click.Context(self)))}."
            _fail(message, exc.exit_code)
        except click.Abort as exc:  # Click turns Ctrl-C into Abort: still 130, as shells expect
            if isinstance(exc.__context__, KeyboardInterrupt):
                _fail(INTERRUPTED, 130)
            _fail("aborted", 1)
        except KeyboardInterrupt:
            _fail(INTERRUPTED, 130)
        except Exception as exc:
            from stages.run.errors import PipelineError

            if debug:
                raise
            if isinstance(exc, PipelineError):
                _fail(str(exc), exc.exit_code)
            _fail(f"{type(exc).__name__}: {exc} (run again with --debug for the traceback)", 1)
        sys.exit(code if isinstance(code, int) else 0)


INTERRUPTED = "interrupted; files already written are complete, the rest were not written"


def _fail(message: str, code: int) -> None:
    click.echo(f"pipeline: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def run_options(command):
    """--run and --artifacts-dir after a stage as well as before it: people type both."""
    command = click.option("--artifacts-dir", "stage_artifacts_dir", metavar="DIR",
                           type=click.Path(file_okay=False, path_type=Path),
                           help="Same as the group's --artifacts-dir.")(command)
    return click.option("--run", "stage_run", metavar="NAME",
                        help="Same as the group's --run.")(command)


class OptionsAnywhere(click.Command):
    """A stage whose options may follow its paths (`predict photos/ --top-k 3`): in a chain
    Click parses a stage's options only up to its first argument. Only for stages that end a
    chain, since every word after such a stage's options is one of its arguments."""

    def make_context(self, info_name, args, parent=None, **extra):
        return super().make_context(info_name, args, parent,
                                    **extra | {"allow_interspersed_args": True})


def take_run_options(ctx: click.Context, flags: dict) -> None:
    """Move a stage's --run/--artifacts-dir into the chain's choice; two different values for
    one chain are refused, since every stage of a chain works on one run."""
    chosen = ctx.find_root().obj.setdefault("chosen", {})
    for key, value in (("run_name", flags.pop("stage_run")),
                       ("artifacts_dir", flags.pop("stage_artifacts_dir"))):
        if value is None:
            continue
        if chosen.get(key) not in (None, value):
            flag = "--run" if key == "run_name" else "--artifacts-dir"
            raise click.UsageError(f"{flag} is given twice with different values ({chosen[key]} "
                                   f"and {value}); a chain works on one run")
        chosen[key] = value


def as_usage_error(build: Callable, *args, **kwargs):
    """What ``build`` returns; its ValueError (a config that cannot be) a usage error (exit 2)."""
    try:
        return build(*args, **kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


# Fields the command line always gives as arguments (`predict PATH...`, `export OUT_DIR`):
# in a file they would be replaced without a word.
ARGUMENTS = {"paths", "out_dir"}


def read_config_file(path: Path) -> dict[str, dict]:
    """The stage tables ([train], [quantize], ...) of a TOML file, unknown keys refused."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    for stage, table in data.items():
        if stage not in cfg.STAGE_CONFIGS:
            raise ValueError(f"--config {path}: unknown table [{stage}]; known: "
                             f"{', '.join(cfg.STAGE_CONFIGS)}")
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: [{stage}] must be a table of settings")
        known = {f.name for f in dataclasses.fields(cfg.STAGE_CONFIGS[stage])} - ARGUMENTS
        for key, value in table.items():
            if key not in known:
                raise ValueError(f"--config {path}: unknown key {key!r} in [{stage}]; known: "
                                 f"{', '.join(sorted(known))}")
            if key in DURATION_FIELDS and isinstance(value, str):
                continue  # a duration such as "5m": parsed, and refused, by its config
            problem = type_error(cfg.STAGE_CONFIGS[stage], {key: value})
            if problem:
                raise ValueError(f"--config {path}: {key} in [{stage}] {problem}")
    return data


def config_from_flags(ctx: click.Context, stage: str, flags: dict):
    """Defaults < --config file < flags."""
    return as_usage_error(cfg.build_config, stage, ctx.obj["file"].get(stage, {}), flags)


def stage_options(stage: str, *names: str):
    """Decorator: an option for each of ``stage``'s config fields that pipeline/flags.py
    describes (those named, or all of them), its type and shown default read from the
    dataclass. Every option defaults to None, so that a --config file's value stands where
    the flag is not given."""
    from pipeline.flags import FLAGS

    config_class = cfg.STAGE_CONFIGS[stage]
    hints = typing.get_type_hints(config_class)
    defaults = {field.name: field.default for field in dataclasses.fields(config_class)}

    def decorate(command):
        for name in reversed(names or tuple(FLAGS[stage])):
            command = _option(name, FLAGS[stage][name], hints[name], defaults[name])(command)
        return command

    return decorate


def _option(name: str, flag, hint, default):
    dashed = "--" + name.replace("_", "-")
    kind = _kind(hint)
    shown = flag.default if flag.default is not None else _shown(default, dashed)
    text = flag.help if flag.flag else f"{flag.help}  [default: {shown}]"
    if kind is bool:
        if flag.flag:
            return click.option(dashed, is_flag=True, default=None, help=text)
        return click.option(f"{dashed}/--{flag.off or 'no-' + dashed[2:]}", default=None,
                            help=text)
    kwargs = {"default": None, "metavar": flag.metavar, "help": text, "multiple": flag.multiple}
    if flag.choices:
        kwargs["type"] = click.Choice(flag.choices)
    elif flag.path:
        kwargs["type"] = click.Path(file_okay=flag.path == "file", dir_okay=flag.path == "dir")
    elif kind in (int, float) and name not in DURATION_FIELDS:  # a duration may be "5m"
        kwargs["type"] = kind
    return click.option(dashed, **kwargs)


def _kind(hint) -> type:
    """The type a flag takes: the field's, less None; str where it is a union of others
    (--lr: a number or auto) or a tuple (a comma list)."""
    kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)] or [hint]
    kind = kinds[0] if len(kinds) == 1 else str
    return str if typing.get_origin(kind) is tuple else kind


def _shown(default, dashed: str) -> str:
    if isinstance(default, bool):
        return dashed[2:] if default else f"no-{dashed[2:]}"
    if isinstance(default, tuple):
        return ",".join(map(str, default)) or "none"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def with_group_values(ctx: click.Context, flags: dict, *keys: str) -> dict:
    """A stage's flags with the group's values it takes (seed, device, quiet), where the user
    gave them: a group default must not hide a --config file's [stage] value."""
    return flags | {key: ctx.obj[key] for key in keys if key in ctx.obj["given"]}

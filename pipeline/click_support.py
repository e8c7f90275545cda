"""The Click pieces the commands of pipeline/cli.py share: the group's handling of failure (one
line on stderr and an exit code), commands whose options may follow their paths, the --run and
--artifacts-dir a stage may carry, the data flags of train and import, and a stage config built
from the flags (a config that cannot be is a usage error, exit 2).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import click

from pipeline import config as cfg


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


def config_from_flags(ctx: click.Context, stage: str, flags: dict):
    """Defaults < --config file < flags."""
    return as_usage_error(cfg.build_config, stage, ctx.obj["file"].get(stage, {}), flags)


def data_options(command):
    """Where the data comes from: the same flags for train and import."""
    for option in reversed([
        click.option("--model", help="A built-in (smallcnn, mixer), any torchvision "
                     "classification model, timm:NAME, or package.module:factory for your "
                     "own.  [default: resnet18]"),
        click.option("--dataset", type=click.Choice(cfg.DATASET_NAMES),
                     help="[default: digits, built in]"),
        click.option("--data-dir", type=click.Path(file_okay=False),
                     help="Where torchvision data sets or your image folder live.  "
                          "[default: data]"),
        click.option("--download/--no-download", default=None,
                     help="Let torchvision fetch the data set where the network allows."),
        click.option("--val-fraction", type=float, help="Share of the training split held out "
                     "to choose with (best epoch, --auto, the recommendation).  [default: 0.1]"),
        click.option("--image-size", type=int, help="Side of the square input in pixels.  "
                     "[default: 32]"),
        click.option("--in-channels", type=click.Choice(["1", "3"]), callback=_whole_number,
                     help="Input channels of the model; grey images are widened to 3 if asked."),
        click.option("--skip-bad-images", is_flag=True, default=None,
                     help="Skip unreadable files in an image folder (counted) instead of "
                          "stopping."),
    ]):
        command = option(command)
    return command


def with_group_values(ctx: click.Context, flags: dict, *keys: str) -> dict:
    """A stage's flags with the group's values it takes (seed, device, quiet), where the user
    gave them: a group default must not hide a --config file's [stage] value."""
    return flags | {key: ctx.obj[key] for key in keys if key in ctx.obj["given"]}


def _whole_number(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A Choice of numbers as a number (Click 8.1's Choice holds strings)."""
    return None if value is None else int(value)

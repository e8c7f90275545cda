"""`pipeline`: a chained Click group. `pipeline train quantize report` runs the stages in order on
one run; each stage also runs alone on the latest run or on `--run NAME`.

Following Click's imagepipe example, each command only turns its flags into a stage config and
returns a processor; the group's result callback applies the processors in order. Nothing here
imports torch at module level, so `--help` is instant.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable

import click

from pipeline import config as cfg

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
Processor = tuple[str, Callable]


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


def _run_options(command):
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


def _take_run_options(ctx: click.Context, flags: dict) -> None:
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


def _build(ctx: click.Context, stage: str, flags: dict):
    """Defaults < --config file < flags; a config error is a usage error (exit 2)."""
    try:
        return cfg.build_config(stage, ctx.obj["file"].get(stage, {}), flags)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@click.group(cls=PipelineGroup, chain=True, context_settings=CONTEXT)
@click.option("--artifacts-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("artifacts"), show_default=True, envvar="PIPELINE_ARTIFACTS_DIR",
              help="Folder that holds runs/ and the pointer to the latest run.")
@click.option("--run", "run_name", metavar="NAME", envvar="PIPELINE_RUN",
              help="Run to work on. train: name of the new run (default: a timestamp); "
                   "other stages: an existing run, by name or its folder's path (default: the "
                   "latest). Under torchrun, whose "
                   "own parser takes --run for --run-path, set PIPELINE_RUN instead.")
@click.option("--device", type=click.Choice(cfg.DEVICES), default="auto", show_default=True,
              help="Where to train; the report measures every variant on the CPU and, where "
                   "there is a CUDA device (unless cpu), the float models on the GPU too.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seeds initial weights, data order, splits and calibration samples.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="TOML file with a table per stage: [train], [import], "
              "[qat], [quantize], [report].")
@click.option("--quiet", is_flag=True, help="No progress bars or per-epoch lines.")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, artifacts_dir, run_name, device, seed, config_file, quiet, debug):
    """Train an image classifier with mixed precision, quantize it to int8 and report, with
    measured numbers, what each step bought.

    \b
    pipeline train quantize report              whole chain on the built-in digits data
    pipeline quantize --methods torch-static    on the latest run
    pipeline report --run NAME --batch-sizes 1,8
    pipeline import --model mymodels:net --weights net.pt quantize report
    """
    try:
        file_values = cfg.read_config_file(config_file) if config_file else {}
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    ctx.obj = {"file": file_values, "seed": seed, "device": device, "quiet": quiet,
               "chosen": {}}
    # Given on the command line, the group's values must agree with a stage's; from the
    # environment or by default, a stage's flag overrides them.
    for key, value in (("run_name", run_name), ("artifacts_dir", artifacts_dir)):
        if ctx.get_parameter_source(key) == click.core.ParameterSource.COMMANDLINE:
            ctx.obj["chosen"][key] = value


CREATES_A_RUN = ("train", "import")  # the first stage of a chain that starts a new run


@cli.result_callback()
@click.pass_context
def run_chain(ctx: click.Context, processors: list[Processor], artifacts_dir: Path,
              run_name: str | None, **_: object) -> None:
    """Open (or, for train and import, create) the run once, then apply every stage to it in
    order. Training (train, qat) runs on every torchrun rank; the rest on rank 0 alone."""
    from stages.run import artifacts
    from stages.training import distributed

    if not processors:
        return
    chosen = ctx.obj["chosen"]
    artifacts_dir = chosen.get("artifacts_dir", artifacts_dir)
    run_name = chosen.get("run_name", run_name)
    _cap_isa_before_any_kernel(ctx, processors)
    world = distributed.setup(ctx.obj["device"])  # a single process unless torchrun started us
    try:
        for _, process in processors:  # input no stage can work with, refused before any starts
            getattr(process, "check", lambda artifacts_dir: None)(Path(artifacts_dir))
        if processors[0][0] in CREATES_A_RUN and not ctx.obj.get("resume"):
            # Input that cannot work (a model that does not import, weights that are not
            # weights) is refused before a run folder exists or `latest` moves to it.
            getattr(processors[0][1], "preflight", lambda: None)()
            # Rank 0 makes the run folder; every rank then works on the same run.
            name = artifacts.create_run(artifacts_dir, run_name).name if world.is_main else None
            run = artifacts.Run(Path(artifacts_dir), distributed.broadcast(name))
            if world.is_main:
                click.echo(f"run {run.name}: {run.root}", err=True)
        else:
            run = artifacts.open_run(artifacts_dir, run_name)  # fails before any work starts
        stages = " ".join(stage for stage, _ in processors)
        reads_only = all(stage in READS_ONLY for stage, _ in processors)
        with (artifacts.hold_run(run, stages) if world.is_main and not reads_only
              else contextlib.nullcontext()):
            for stage, process in processors:
                if stage not in ("train", "qat") and not world.is_main:
                    continue  # quantize and report are single-process work for rank 0
                seconds = _run_stage(run, stage, process,
                                     world.is_main and stage not in READS_ONLY)
                if world.is_main and not ctx.obj["quiet"] and stage not in READS_ONLY:
                    click.echo(f"{stage}: done in {_duration(seconds)}", err=True)
    finally:
        distributed.teardown()


def _cap_isa_before_any_kernel(ctx: click.Context, processors: list[Processor]) -> None:
    """bf16 training on an AMX CPU needs oneDNN capped below AMX before its first kernel
    (stages/precision.py says why); this is the last moment before any runs."""
    if not any(stage in ("train", "qat") for stage, _ in processors):
        return
    from stages.training.precision import cap_isa_for_bf16_training

    precision = ctx.obj.get("train_precision") or "auto"
    if ctx.obj.get("resume"):  # the precision the run was started with
        from stages.run.artifacts import open_run

        chosen = ctx.obj["chosen"]
        try:
            run = open_run(chosen.get("artifacts_dir", Path("artifacts")), chosen.get("run_name"))
            precision = run.recorded_config("train").get("resolved_precision", precision)
        except Exception:  # a missing run is reported by run_chain, with its own message
            pass
    capped = cap_isa_for_bf16_training(precision, ctx.obj["device"])
    if capped:
        click.echo(f"bf16 training on a CPU with AMX: oneDNN capped at {capped} for this "
                   "process (AMX bf16 kernels of this torch give wrong results)", err=True)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _run_stage(run, stage: str, process: Callable, writes: bool) -> float:
    """Mark the stage running, then complete or failed, so that a run is never taken for
    complete when a stage died half-way; returns the seconds it took. Signals wait for each
    status write: in CI, torchrun's SIGTERM reached rank 0 while it wrote its own failure and
    left the stage `running`."""
    import time

    started = time.perf_counter()
    try:
        if writes:  # inside the try: a signal held back during this write is delivered here
            with _status_write():
                run.mark_stage(stage, "running")
        process(run)
    except BaseException as exc:
        if writes:
            with _status_write():
                try:
                    run.mark_stage(stage, "failed", f"{type(exc).__name__}: {exc}"[:500])
                except Exception:  # the disk may be what failed; the original error matters more
                    pass
        raise
    seconds = time.perf_counter() - started
    if writes:
        with _status_write():
            run.mark_stage(stage, "complete", seconds=round(seconds, 1))
    return seconds


def _status_write():
    """What a stage's status write holds back: Ctrl-C, kill and torchrun, dying loader workers."""
    import signal

    from stages.run.signals import deferred

    return deferred(signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)


def _data_options(command):
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
        click.option("--in-channels", type=click.Choice(["1", "3"]),
                     help="Input channels of the model; grey images are widened to 3 if asked."),
        click.option("--skip-bad-images", is_flag=True, default=None,
                     help="Skip unreadable files in an image folder (counted) instead of "
                          "stopping."),
    ]):
        command = option(command)
    return command


def _common(ctx: click.Context, flags: dict, *keys: str) -> dict:
    flags |= {key: ctx.obj[key] for key in keys}
    if flags.get("in_channels") is not None:
        flags["in_channels"] = int(flags["in_channels"])
    return flags


@cli.command(context_settings=CONTEXT)
@click.option("--resume", is_flag=True, help="Continue the latest run (or --run NAME) from its "
              "newest good checkpoint, with the configuration it was started with.")
@_data_options
@click.option("--epochs", type=int, help="Epochs at most.  [default: 5]")
@click.option("--time", metavar="DURATION", help="Training time (90s, 10m, 1h) shared by the "
              "models trained: after each epoch the epochs that fit at the pace so far are "
              "planned again, the learning-rate schedule with them.  [default: no limit]")
@click.option("--patience", type=int, metavar="EPOCHS", help="Stop once validation accuracy has "
              "not improved for this many epochs; the best epoch is kept.  [default: 5]")
@click.option("--batch-size", type=int, help="[default: 64]")
@click.option("--lr", metavar="LR|auto", help="Peak learning rate of SGD (cosine, warm-up); "
              "auto: found by a learning-rate range test of up to 100 steps.  [default: 0.02]")
@click.option("--weight-decay", type=float, help="[default: 5e-4]")
@click.option("--label-smoothing", type=float, help="[default: 0]")
@click.option("--grad-clip", type=float, help="Max gradient norm, 0 for none (clips after "
              "unscaling).  [default: 0]")
@click.option("--precision", type=click.Choice(cfg.PRECISIONS),
              help="Autocast type of the amp model; auto: fp16 with GradScaler on CUDA; on a CPU "
                   "bf16 where it has bf16 instructions (AVX-512 BF16, AMX), else fp32.")
@click.option("--baseline/--no-baseline", default=None, help="Also train the fp32 baseline.  "
              "[default: baseline]")
@click.option("--init-weights", type=click.Path(dir_okay=False), metavar="FILE",
              help="Start from this state_dict or checkpoint (weights-only); a classifier for "
                   "another number of classes is replaced.")
@click.option("--weights", metavar="NAME", help="Start from torchvision's pretrained weights "
              "(DEFAULT, IMAGENET1K_V1, ...), read from the local torch hub cache.")
@click.option("--workers", type=int, help="DataLoader worker processes.  [default: 0]")
@click.option("--loader-timeout", type=float, metavar="SECONDS",
              help="Give up on a DataLoader worker silent this long.  [default: 300]")
@click.option("--checkpoint-every", type=int, metavar="STEPS",
              help="Also checkpoint every STEPS optimizer steps.  [default: 0, epochs only]")
@click.option("--keep-checkpoints", type=int, help="Newest checkpoints kept (plus the best).  "
              "[default: 2]")
@click.option("--max-skipped-steps", type=int, help="Stop when GradScaler skips more steps than "
              "this in a row.  [default: 25]")
@click.option("--deterministic/--no-deterministic", default=None,
              help="torch.use_deterministic_algorithms, for bit-identical resumes.")
@click.option("--measure-memory/--no-measure-memory", default=None,
              help="Measure each model's training memory in a fresh process (a few seconds "
                   "each).  [default: measure]")
@_run_options
@click.pass_context
def train(ctx: click.Context, resume: bool, **flags) -> Processor:
    """Train the `amp` model and the `fp32` baseline; save fp32 master-weight checkpoints."""
    _take_run_options(ctx, flags)
    if resume:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        if given:
            raise click.UsageError(f"--resume continues with the run's saved configuration; "
                                   f"drop {', '.join(given)}")
    ctx.obj["resume"] = resume
    flags = _common(ctx, flags, "seed", "device", "quiet")
    config = None if resume else _build(ctx, "train", flags)
    ctx.obj["train_precision"] = config.precision if config else None

    def process(run) -> None:
        from stages import train as train_stage

        chosen = config or _saved_train_config(ctx, run)
        train_stage.run(chosen, run, resume=resume)
        for name in ("fp32", "amp"):
            if name in run.artifacts():
                click.echo(f"{name}: {run.root / run.entry(name)['path']}")

    if config is not None:
        from stages import train as train_stage

        process.preflight = lambda: train_stage.preflight(config)
    return "train", process


def _saved_train_config(ctx: click.Context, run) -> "cfg.TrainConfig":
    """The configuration a run was started with, for --resume; quiet and device are today's."""
    saved = run.recorded_config("train")
    if not saved:
        raise click.UsageError(f"run {run.name!r} has no saved training configuration to resume")
    fields = {f for f in cfg.TrainConfig.__dataclass_fields__}
    values = {k: v for k, v in saved.items() if k in fields}
    return cfg.TrainConfig(**values | {"quiet": ctx.obj["quiet"], "device": ctx.obj["device"]})


@cli.command("import", context_settings=CONTEXT)
@_data_options
@click.option("--weights", metavar="FILE|NAME", help="The weights to import: a state_dict or "
              "checkpoint file (weights-only), or torchvision's pretrained weights by name.")
@_run_options
@click.pass_context
def import_(ctx: click.Context, **flags) -> Processor:
    """Register a model trained elsewhere as the run's `fp32` model, to quantize and report."""
    _take_run_options(ctx, flags)
    config = _build(ctx, "import", _common(ctx, flags, "seed", "quiet"))

    def process(run) -> None:
        from stages import import_model

        import_model.run(config, run)
        click.echo(f"fp32: {run.root / run.entry('fp32')['path']}")

    from stages import import_model

    process.preflight = lambda: import_model.preflight(config)
    return "import", process


@cli.command(context_settings=CONTEXT)
@click.option("--epochs", type=int, help="Epochs of fine-tuning.  [default: 10]")
@click.option("--lr", type=float, help="Peak learning rate.  [default: 0.005]")
@click.option("--batch-size", type=int, help="[default: 64]")
@click.option("--freeze-bn-after", type=int, metavar="EPOCHS",
              help="BatchNorm statistics stop updating after this many epochs.  "
                   "[default: half of --epochs]")
@click.option("--freeze-observers-after", type=int, metavar="EPOCHS",
              help="Quantization ranges stop updating after this many epochs.  "
                   "[default: 70% of --epochs]")
@click.option("--precision", type=click.Choice(cfg.PRECISIONS),
              help="Autocast type of the fine-tuning; auto: fp32, which torchao's fake "
                   "quantizers need (bf16 or fp16 fail where an activation reaches one in "
                   "half precision).")
@click.option("--tuning-time", metavar="DURATION",
              help="Time the fine-tuning may take (90s, 5m, 1h): once an epoch is timed, the "
                   "epochs and the freezes are cut to what fits.  [default: no limit]")
@_run_options
@click.pass_context
def qat(ctx: click.Context, **flags) -> Processor:
    """Fine-tune the float model with fake quantization: `torch-qat` and `ort-qat`."""
    _take_run_options(ctx, flags)
    config = _build(ctx, "qat", _common(ctx, flags, "seed", "device", "quiet"))

    def process(run) -> None:
        from stages import qat as qat_stage

        for variant in qat_stage.run(config, run):
            click.echo(f"{variant}: {run.root / run.entry(variant)['path']}")

    return "qat", process


@cli.command(context_settings=CONTEXT)
@click.option("--methods", help="Comma list of " + ", ".join(cfg.QUANT_METHODS) +
              ", or all.  [default: all]")
@click.option("--calibration-samples", type=int,
              help="Training images static quantization observes.  [default: 512]")
@click.option("--calibration-method", type=click.Choice(cfg.CALIBRATION_METHODS),
              help="ONNX Runtime static calibration.  [default: minmax]")
@click.option("--per-channel/--per-tensor", default=None,
              help="ONNX Runtime static weight scales.  [default: per-tensor]")
@click.option("--ort-types", type=click.Choice(cfg.ORT_TYPES),
              help="ORT activation/weight types.  [default: u8s8]")
@click.option("--ort-format", type=click.Choice(cfg.ORT_FORMATS),
              help="ORT static graph format; QOperator only on request.  [default: qdq]")
@click.option("--equalize/--no-equalize", default=None,
              help="Cross-layer equalization of the float model before torch-static and "
                   "ort-static (outputs unchanged; evens per-channel weight ranges).  [default: "
                   "with per-tensor weights; --auto also tries it for torch-static]")
@click.option("--auto", is_flag=True, default=None,
              help="Try several static configurations per backend on held-out training images; "
                   "keep the fastest within --max-accuracy-drop.")
@click.option("--max-accuracy-drop", type=float, metavar="POINTS",
              help="Held-out accuracy (points) a static model may lose against its float "
                   "source, at 95% confidence; beyond it, sensitive layers stay float, and a "
                   "model that still misses it is not kept.  [default: 1.0]")
@click.option("--tuning-time", metavar="DURATION",
              help="Time each static backend's search may take (90s, 5m, 1h): what was not "
                   "reached is not tried.  [default: no limit]")
@_run_options
@click.pass_context
def quantize(ctx: click.Context, **flags) -> Processor:
    """Make the deployable variants of the run's float model (PyTorch, ONNX Runtime, OpenVINO)."""
    _take_run_options(ctx, flags)
    flags = _common(ctx, flags, "seed", "quiet")
    for switch in ("per_channel", "equalize"):
        if flags.get(switch) is not None:
            flags[switch] = bool(flags[switch])
    config = _build(ctx, "quantize", flags)
    # --auto falls back to QAT (with its own defaults, in quantize's --tuning-time unless [qat]
    # sets one) only when no post-training configuration meets the budget; built here so a bad
    # [qat] table stops early.
    qat_flags = ({} if "tuning_time" in ctx.obj["file"].get("qat", {})
                 else {"tuning_time": config.tuning_time})
    qat_config = (_build(ctx, "qat", _common(ctx, qat_flags, "seed", "device", "quiet"))
                  if config.auto else None)

    def process(run) -> None:
        from stages import quantize as quantize_stage

        made = list(quantize_stage.run(config, run))
        if qat_config is not None:
            met, why = quantize_stage.post_training_verdict(run, made,
                                                            config.max_accuracy_drop)
            click.echo(f"--auto: {why}" + ("" if met else "; trying quantization-aware training"))
            if not met:
                from stages import qat as qat_stage
                from stages.run.errors import Diverged

                try:
                    made += qat_stage.run(qat_config, run)
                except Diverged as exc:  # the post-training variants above still stand
                    click.echo(f"--auto: quantization-aware training made nothing: {exc}")
        for variant in made:
            if variant in run.artifacts():  # a search that kept nothing said so already
                click.echo(f"{variant}: {run.root / run.entry(variant)['path']}")

    return "quantize", process


@cli.command(context_settings=CONTEXT)
@click.option("--batch-sizes", help="Comma list of batch sizes to time.  [default: 1,32]")
@click.option("--threads", type=int, help="Threads for every runtime alike; 0: the machine's "
              "cores, at most 8.  [default: 0]")
@click.option("--rounds", type=int, help="Rounds of timing at least; every variant is timed in "
              "each, the order rotated.  [default: 5]")
@click.option("--max-rounds", type=int, help="Rounds of timing at most.  [default: 40]")
@click.option("--repeats", type=int, help="Timed calls per variant in each round; 0: as many as "
              "fill 50 ms.  [default: 0]")
@click.option("--target-interval", type=float, metavar="RATIO",
              help="Time until every speed-up against the fastest float has a 95% interval "
                   "with high/low at most this.  [default: 1.1]")
@click.option("--timing-budget", type=float, metavar="SECONDS",
              help="Stop adding rounds after this long, per batch size.  [default: 20]")
@click.option("--warmup", type=int, help="Untimed calls first.  [default: 3]")
@click.option("--max-accuracy-drop", type=float, metavar="POINTS",
              help="Held-out accuracy (points) the recommended variant may lose against "
                   "the model the variants were made from (amp; fp32 where amp is its copy), "
                   "at 95% confidence.  [default: 1.0]")
@click.option("--fail-under-speedup", type=float, metavar="X",
              help="Exit 1 when the recommended variant is less than X times faster than the "
                   "model it was made from (amp; fp32 where amp is its copy).")
@click.option("--fail-under-float-speedup", type=float, metavar="X",
              help="Exit 1 when the recommended variant is less than X times faster than the "
                   "fastest float variant (the report's headline ratio).")
@click.option("--compare", multiple=True, metavar="RUN[,RUN...]",
              help="Also put these runs' reports side by side with this one (compare.md).")
@_run_options
@click.pass_context
def report(ctx: click.Context, **flags) -> Processor:
    """Measure every variant the same way; write report.md, report.json and plots."""
    _take_run_options(ctx, flags)
    flags |= {"quiet": ctx.obj["quiet"], "compare": flags["compare"] or None,
              "device": ctx.obj["device"]}
    config = _build(ctx, "report", flags)

    def process(run) -> None:
        from stages import report as report_stage

        result = report_stage.run(config, run)
        click.echo(report_stage.summary_table(result))
        if config.compare:
            click.echo(f"compare: {run.root / 'report' / 'compare.md'}")
        click.echo(f"report: {run.root / 'report' / 'report.md'}")

    def check(artifacts_dir: Path) -> None:
        from stages.run.artifacts import list_runs

        known = list_runs(artifacts_dir)
        missing = [name for name in config.compare or () if name not in known]
        if missing:
            raise click.UsageError(
                f"--compare: no run {', '.join(map(repr, missing))} in {artifacts_dir}; existing "
                f"runs: {', '.join(known) or 'none'}")

    process.check = check
    return "report", process


@cli.command(cls=OptionsAnywhere, context_settings=CONTEXT)
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--variant", help="A variant's name, or recommended (the report's choice).  "
              "[default: recommended]")
@click.option("--top-k", type=int, help="Classes printed per image.  [default: 1]")
@click.option("--batch-size", type=int, help="Images decoded and predicted together.  "
              "[default: 64]")
@click.option("--json", "json_lines", is_flag=True, default=None,
              help="One JSON object per image instead of text.")
@_run_options
@click.pass_context
def predict(ctx: click.Context, paths, json_lines, **flags) -> Processor:
    """Predict image files (or folders of them) with a variant of the run: one line each.

    Must come last in a chain: it takes every word after it as a path or one of its options."""
    _take_run_options(ctx, flags)
    config = _build(ctx, "predict", flags | {"paths": paths, "json": json_lines})

    def process(run) -> None:
        from pipeline.api import load
        from stages.data.preprocess import image_files, print_predictions, skipped_summary
        from stages.run.errors import PipelineError, UsageError

        files, empty = image_files(config.paths)
        if empty:
            raise UsageError(f"{', '.join(map(str, empty))}: no files in this folder")
        model = load(run.root, config.variant, threads=config.threads)
        skipped = print_predictions(files, model.spec, model.predict, config.batch_size,
                                    config.top_k, "pipeline",
                                    model.variant if config.json else None)
        if skipped:
            raise PipelineError(skipped_summary(skipped, len(files)))

    return "predict", process


@cli.command("export", cls=OptionsAnywhere, context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--variant", help="A variant's name, or recommended (the report's choice).  "
              "[default: recommended]")
@_run_options
@click.pass_context
def export(ctx: click.Context, **flags) -> Processor:
    """Write a variant as a folder that runs without this project: its model file(s),
    preprocessing.json, predict.py and a manifest.json of sha256."""
    _take_run_options(ctx, flags)
    config = _build(ctx, "export", flags | {"quiet": ctx.obj["quiet"]})

    def process(run) -> None:
        from stages import export as export_stage

        click.echo(f"export: {export_stage.run(config, run)}")

    return "export", process


READS_ONLY = ("predict", "export")  # they change nothing in the run: no lock, no stage status


def _fail_stage_on_sigterm() -> None:
    """SIGTERM (torchrun stopping the other ranks when one fails, or a user's kill) raises
    SystemExit, so that the stage under way is marked failed; Python's default ends the
    process where it stands and leaves the stage 'running'. A second SIGTERM ends the process
    at once, as the default would: what the first started may be stuck (a thread blocked in a
    read), and `timeout`, systemd and Kubernetes count on SIGTERM working. A status write in
    progress is not cut short: it holds signals back (_status_write) and meets this after."""
    import signal

    def stop(signum, frame):
        # The default action for the next one, set by the kernel: a Python handler would wait
        # for the main thread to come back from the C code it may be stuck in.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    _fail_stage_on_sigterm()
    cli(prog_name="pipeline")

"""`pipeline`: a chained Click group. `pipeline train quantize report` runs the stages in order on
one run; each stage also runs alone on the latest run or on `--run NAME`.

Following Click's imagepipe example, each command only turns its flags into a stage config and
returns a processor that calls the stage; the group's result callback hands the processors to
pipeline/chain.py, which applies them in order to one run. What the commands share is in
pipeline/click_support.py. Nothing here imports torch at module level, so `--help` is instant.
"""
from __future__ import annotations

from pathlib import Path

import click

from pipeline import chain, checks
from pipeline import config as cfg
from pipeline.chain import Processor
from pipeline.click_support import (
    OptionsAnywhere,
    PipelineGroup,
    as_usage_error,
    config_from_flags,
    read_config_file,
    run_options,
    stage_options,
    take_run_options,
    with_group_values,
)
from stages import catalog

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


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
@click.option("--seed", type=click.IntRange(0, checks.MAX_SEED), default=0, show_default=True,
              help="Seeds initial weights, data order, splits and calibration samples.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), envvar="PIPELINE_CONFIG", help="TOML file with a table per "
              "stage: [train], [import], [qat], [quantize], [report], [predict], [export]; "
              "or set PIPELINE_CONFIG. A stage's flags override it.")
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
    file_values = as_usage_error(read_config_file, config_file) if config_file else {}
    default = click.core.ParameterSource.DEFAULT
    ctx.obj = {"file": file_values, "seed": seed, "device": device, "quiet": quiet,
               "chosen": {}, "given": {key for key in ("seed", "device", "quiet")
                                       if ctx.get_parameter_source(key) != default}}
    # Given on the command line, the group's values must agree with a stage's; from the
    # environment or by default, a stage's flag overrides them.
    for key, value in (("run_name", run_name), ("artifacts_dir", artifacts_dir)):
        if ctx.get_parameter_source(key) == click.core.ParameterSource.COMMANDLINE:
            ctx.obj["chosen"][key] = value


@cli.result_callback()
@click.pass_context
def run_chain(ctx: click.Context, processors: list[Processor], artifacts_dir: Path,
              run_name: str | None, **_: object) -> None:
    """Apply every stage to one run, in order (pipeline/chain.py); `list` works on no run."""
    if any(stage == "list" for stage, _ in processors):
        if len(processors) > 1:
            raise click.UsageError("list works alone: give it no other stage")
        processors[0][1]()
        return
    chosen = ctx.obj["chosen"]
    chain.run_chain(processors, chosen.get("artifacts_dir", artifacts_dir),
                    chosen.get("run_name", run_name), device=ctx.obj["device"],
                    quiet=ctx.obj["quiet"], resume=bool(ctx.obj.get("resume")),
                    train_precision=ctx.obj.get("train_precision"))


# What --resume takes from today's flags beside --quiet and --device: how the data loads, not
# what trains (a dead DataLoader worker's error says to resume with --workers 0).
RESUME_TAKES = ("workers", "loader_timeout")


@cli.command(context_settings=CONTEXT)
@click.option("--resume", is_flag=True, help="Continue the latest run (or --run NAME) from its "
              "newest good checkpoint, with the configuration it was started with (of the "
              "train flags, --workers and --loader-timeout may be given).")
@stage_options("train")
@run_options
@click.pass_context
def train(ctx: click.Context, resume: bool, **flags) -> Processor:
    """Train the `amp` model and the `fp32` baseline; save fp32 master-weight checkpoints."""
    take_run_options(ctx, flags)
    table = ctx.obj["file"].get("train", {})
    todays = [k for k in RESUME_TAKES if flags[k] is not None or k in table] if resume else []
    if resume:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items()
                 if v is not None and k not in todays] + (
            ["--seed"] if "seed" in ctx.obj["given"] else []) + [
            f"{k} from the [train] table of --config" for k in table if k not in RESUME_TAKES]
        if given:
            raise click.UsageError(f"--resume continues with the run's saved configuration; "
                                   f"drop {', '.join(given)}")
    ctx.obj["resume"] = resume
    flags = with_group_values(ctx, flags, "seed", "device", "quiet")
    # --resume: the stage takes the run's own configuration, with today's quiet and device
    # (and how the data loads, where given).
    today = {"quiet": ctx.obj["quiet"], "device": ctx.obj["device"]} | {k: flags[k] for k in todays}
    config = config_from_flags(ctx, "train", today if resume else flags)
    ctx.obj["train_precision"] = None if resume else config.precision

    def process(run) -> None:
        from stages import train as train_stage
        from stages.training import distributed

        train_stage.run(config, run, resume=resume, resume_keeps=tuple(todays))
        if not distributed.current().is_main:  # the paths once, from the rank that wrote them
            return
        for name in ("fp32", "amp"):
            if name in run.artifacts():
                click.echo(f"{name}: {run.root / run.entry(name)['path']}")

    from stages import train as train_stage

    process.preflight = lambda: train_stage.preflight(config)  # not run under --resume
    process.device = config.device
    return "train", process


@cli.command("import", context_settings=CONTEXT)
@stage_options("import")
@run_options
@click.pass_context
def import_(ctx: click.Context, **flags) -> Processor:
    """Register a model trained elsewhere as the run's `fp32` model, to quantize and report."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "import", with_group_values(ctx, flags, "seed", "quiet"))

    def process(run) -> None:
        from stages import import_model

        import_model.run(config, run)
        click.echo(f"fp32: {run.root / run.entry('fp32')['path']}")

    from stages import import_model

    process.preflight = lambda: import_model.preflight(config)
    return "import", process


@cli.command(context_settings=CONTEXT)
@stage_options("qat")
@run_options
@click.pass_context
def qat(ctx: click.Context, **flags) -> Processor:
    """Fine-tune the float model with fake quantization: `torch-qat`, `ort-qat`, `openvino-qat`."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "qat", with_group_values(ctx, flags, "seed", "device", "quiet"))

    def process(run) -> None:
        from stages import qat as qat_stage

        for variant in qat_stage.run(config, run):
            click.echo(f"{variant}: {run.root / run.entry(variant)['path']}")

    process.trains_in = config.fine_tunes_in
    return "qat", process


@cli.command(context_settings=CONTEXT)
@stage_options("quantize")
@run_options
@click.pass_context
def quantize(ctx: click.Context, **flags) -> Processor:
    """Make the deployable variants of the run's float model (PyTorch, ONNX Runtime, OpenVINO)."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "quantize", with_group_values(ctx, flags, "seed", "quiet"))
    qat_config = as_usage_error(cfg.qat_config_for_auto, config, ctx.obj["file"],
                                **with_group_values(ctx, {}, "seed", "device", "quiet"))

    def process(run) -> None:
        from stages import quantize as quantize_stage

        for variant in quantize_stage.run_as_deployed(config, run, qat_config):
            if variant in run.artifacts():  # a search that kept nothing said so already
                click.echo(f"{variant}: {run.root / run.entry(variant)['path']}")

    process.trains_in = qat_config.fine_tunes_in if qat_config is not None else None
    return "quantize", process


@cli.command(context_settings=CONTEXT)
@stage_options("report")
@run_options
@click.pass_context
def report(ctx: click.Context, **flags) -> Processor:
    """Measure every variant the same way; write report.md, report.json and plots."""
    take_run_options(ctx, flags)
    flags = with_group_values(ctx, flags | {"compare": flags["compare"] or None}, "device",
                              "quiet")
    config = config_from_flags(ctx, "report", flags)

    def process(run) -> None:
        from stages import report as report_stage

        result = report_stage.run(config, run)
        click.echo(report_stage.summary_table(result))
        if config.compare:
            click.echo(f"compare: {run.root / 'report' / 'compare.md'}")
        click.echo(f"report: {run.root / 'report' / 'report.md'}")

    process.check = lambda artifacts_dir: as_usage_error(checks.check_compare_runs, config,
                                                         artifacts_dir)
    return "report", process


@cli.command(cls=OptionsAnywhere, context_settings=CONTEXT)
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@stage_options("predict", "variant", "top_k", "batch_size", "json", "threads")
@run_options
@click.pass_context
def predict(ctx: click.Context, paths, **flags) -> Processor:
    """Predict image files (or folders of them) with a variant of the run: one line each.

    Must come last in a chain: it takes every word after it as a path or one of its options."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "predict", flags | {"paths": paths})

    def process(run) -> None:
        from stages import predict as predict_stage

        predict_stage.run(config, run)

    def check(_) -> None:  # before the stages before it in a chain, not minutes later
        from stages.predict import files_to_predict

        files_to_predict(config.paths)

    process.check, process.variant = check, config.variant
    return "predict", process


@cli.command("export", cls=OptionsAnywhere, context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=str))
@stage_options("export")
@run_options
@click.pass_context
def export(ctx: click.Context, **flags) -> Processor:
    """Write a variant as a folder that runs without this project: its model file(s),
    preprocessing.json, predict.py and a manifest.json of sha256."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "export", with_group_values(ctx, flags, "quiet"))

    def process(run) -> None:
        from stages import export as export_stage

        click.echo(f"export: {export_stage.run(config, run)}")

    def check(_) -> None:  # before the stages before it in a chain, not minutes later
        from stages.export import check_out_dir

        check_out_dir(Path(config.out_dir).expanduser())

    process.check, process.variant = check, config.variant
    return "export", process


@cli.command("list", context_settings=CONTEXT)
@click.argument("registries", nargs=-1, type=click.Choice(catalog.REGISTRIES))
def list_(registries: tuple[str, ...]) -> Processor:
    """What can be named: models (--model), data sets (--dataset), variants (--methods,
    --variant); all three by default. Works on no run, and alone."""
    return "list", lambda: [click.echo(line) for line in catalog.listing(*registries)]


def _fail_stage_on_sigterm() -> None:
    """SIGTERM (torchrun stopping the other ranks when one fails, or a user's kill) raises
    SystemExit, so that the stage under way is marked failed; Python's default ends the
    process where it stands and leaves the stage 'running'. A second SIGTERM ends the process
    at once, as the default would: what the first started may be stuck (a thread blocked in a
    read), and `timeout`, systemd and Kubernetes count on SIGTERM working. A status write in
    progress is not cut short: it holds signals back (chain._status_write) and meets this
    after."""
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

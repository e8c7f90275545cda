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

from pipeline import chain
from pipeline import config as cfg
from pipeline.chain import Processor
from pipeline.click_support import (
    OptionsAnywhere,
    PipelineGroup,
    as_usage_error,
    config_from_flags,
    data_options,
    run_options,
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
    file_values = as_usage_error(cfg.read_config_file, config_file) if config_file else {}
    ctx.obj = {"file": file_values, "seed": seed, "device": device, "quiet": quiet,
               "chosen": {}, "given": {key for key in ("seed", "device", "quiet") if
                                       ctx.get_parameter_source(key) != click.core.ParameterSource.DEFAULT}}
    # Given on the command line, the group's values must agree with a stage's; from the
    # environment or by default, a stage's flag overrides them.
    for key, value in (("run_name", run_name), ("artifacts_dir", artifacts_dir)):
        if ctx.get_parameter_source(key) == click.core.ParameterSource.COMMANDLINE:
            ctx.obj["chosen"][key] = value


@cli.result_callback()
@click.pass_context
def run_chain(ctx: click.Context, processors: list[Processor], artifacts_dir: Path,
              run_name: str | None, **_: object) -> None:
    """Apply every stage to one run, in order (pipeline/chain.py); `list` has printed what it
    lists and gives no stage."""
    processors = [processor for processor in processors if processor is not None]
    chosen = ctx.obj["chosen"]
    chain.run_chain(processors, chosen.get("artifacts_dir", artifacts_dir),
                    chosen.get("run_name", run_name), device=ctx.obj["device"],
                    quiet=ctx.obj["quiet"], resume=bool(ctx.obj.get("resume")),
                    train_precision=ctx.obj.get("train_precision"))


@cli.command(context_settings=CONTEXT)
@click.option("--resume", is_flag=True, help="Continue the latest run (or --run NAME) from its "
              "newest good checkpoint, with the configuration it was started with.")
@data_options
@click.option("--epochs", type=int, help="Epochs at most.  [default: 5; with --time, what "
              "fits it]")
@click.option("--time", metavar="DURATION", help="Time for the stage (90s, 10m, 1h): what "
              "loading the data and --lr auto's range test leave is shared by the models "
              "trained; after each epoch the epochs that fit at the pace so far are planned "
              "again, the learning-rate schedule with them.  [default: no limit]")
@click.option("--patience", type=int, metavar="EPOCHS", help="Stop once validation accuracy has "
              "not improved for this many epochs; the best epoch is kept.  [default: 5]")
@click.option("--batch-size", type=int, help="[default: 64]")
@click.option("--lr", metavar="LR|auto", help="Peak learning rate of SGD (cosine, warm-up); "
              "auto: found by a learning-rate range test (150 steps, then 450 where the loss "
              "did not fall; the linear-scaling rule where the test would outrun training, or "
              "where neither test could be read and 450 steps at it beat guessing on "
              "validation).  [default: auto]")
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
@run_options
@click.pass_context
def train(ctx: click.Context, resume: bool, **flags) -> Processor:
    """Train the `amp` model and the `fp32` baseline; save fp32 master-weight checkpoints."""
    take_run_options(ctx, flags)
    if resume:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        if given:
            raise click.UsageError(f"--resume continues with the run's saved configuration; "
                                   f"drop {', '.join(given)}")
    ctx.obj["resume"] = resume
    flags = with_group_values(ctx, flags, "seed", "device", "quiet")
    # --resume: the stage takes the run's own configuration, with today's quiet and device.
    config = (cfg.TrainConfig(quiet=ctx.obj["quiet"], device=ctx.obj["device"]) if resume
              else config_from_flags(ctx, "train", flags))
    ctx.obj["train_precision"] = None if resume else config.precision

    def process(run) -> None:
        from stages import train as train_stage

        train_stage.run(config, run, resume=resume)
        for name in ("fp32", "amp"):
            if name in run.artifacts():
                click.echo(f"{name}: {run.root / run.entry(name)['path']}")

    from stages import train as train_stage

    process.preflight = lambda: train_stage.preflight(config)  # not run under --resume
    return "train", process


@cli.command("import", context_settings=CONTEXT)
@data_options
@click.option("--weights", metavar="FILE|NAME", help="The weights to import: a state_dict or "
              "checkpoint file (weights-only), or torchvision's pretrained weights by name.")
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

        for variant in quantize_stage.run(config, run, qat_config):
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
@click.option("--time-below-amx/--no-time-below-amx", default=None,
              help="On a CPU with AMX, also time the int8 and bf16 variants that run oneDNN "
                   "with it capped below AMX, and say where that is faster.  [default: on]")
@run_options
@click.pass_context
def report(ctx: click.Context, **flags) -> Processor:
    """Measure every variant the same way; write report.md, report.json and plots."""
    take_run_options(ctx, flags)
    flags |= {"quiet": ctx.obj["quiet"], "compare": flags["compare"] or None,
              "device": ctx.obj["device"]}
    config = config_from_flags(ctx, "report", flags)

    def process(run) -> None:
        from stages import report as report_stage

        result = report_stage.run(config, run)
        click.echo(report_stage.summary_table(result))
        if config.compare:
            click.echo(f"compare: {run.root / 'report' / 'compare.md'}")
        click.echo(f"report: {run.root / 'report' / 'report.md'}")

    process.check = lambda artifacts_dir: as_usage_error(cfg.check_compare_runs, config,
                                                         artifacts_dir)
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
@run_options
@click.pass_context
def predict(ctx: click.Context, paths, json_lines, **flags) -> Processor:
    """Predict image files (or folders of them) with a variant of the run: one line each.

    Must come last in a chain: it takes every word after it as a path or one of its options."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "predict", flags | {"paths": paths, "json": json_lines})

    def process(run) -> None:
        from stages import predict as predict_stage

        predict_stage.run(config, run)

    return "predict", process


@cli.command("export", cls=OptionsAnywhere, context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--variant", help="A variant's name, or recommended (the report's choice).  "
              "[default: recommended]")
@run_options
@click.pass_context
def export(ctx: click.Context, **flags) -> Processor:
    """Write a variant as a folder that runs without this project: its model file(s),
    preprocessing.json, predict.py and a manifest.json of sha256."""
    take_run_options(ctx, flags)
    config = config_from_flags(ctx, "export", flags | {"quiet": ctx.obj["quiet"]})

    def process(run) -> None:
        from stages import export as export_stage

        click.echo(f"export: {export_stage.run(config, run)}")

    return "export", process


@cli.command("list", context_settings=CONTEXT)
@click.argument("registry", required=False, type=click.Choice(catalog.REGISTRIES))
def list_(registry: str | None) -> None:
    """What can be named: models (--model), data sets (--dataset), variants (--methods,
    --variant); all three by default. Works on no run."""
    for line in catalog.listing(registry):
        click.echo(line)


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

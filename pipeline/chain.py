"""Run a chain of stages on one run: what `pipeline train quantize report` does once its flags
are configs. The run is opened (or, for train and import, created) once, held by this process,
and each stage is marked running, then complete or failed, in the run's manifest.

A processor is (stage name, process(run)), made by the stage's Click command; process may carry
check(artifacts_dir) (input no stage can work with, refused before any starts) and, for a stage
that creates the run, preflight() (input that cannot work, refused before the run exists).
Nothing here imports torch at module level.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import click

Processor = tuple[str, Callable]
CREATES_A_RUN = ("train", "import")  # the first stage of a chain that starts a new run
READS_ONLY = ("predict", "export")  # they change nothing in the run: no lock, no stage status
MAKES_VARIANTS = ("train", "import", "quantize", "qat")  # a report before them recommends none
EVERY_RANK = ("train",)  # under torchrun; the other stages run on rank 0 alone


def run_chain(processors: list[Processor], artifacts_dir: Path, run_name: str | None, *,
              device: str, quiet: bool, resume: bool, train_precision: str | None) -> None:
    """Open (or create) the run once, then apply every stage to it in order."""
    from stages.run import lock
    from stages.training import distributed

    if not processors:
        return
    late = next((stage for stage, _ in processors[1:] if stage in CREATES_A_RUN), None)
    if late:  # after another stage it would replace the model of the run that stage used
        from stages.run.errors import UsageError

        raise UsageError(f"{late} starts a run, so it comes first in a chain (pipeline {late} "
                         f"quantize report), not after {processors[0][0]}")
    _check_recommended_has_a_report(processors)
    # Where training runs: train's own device (a [train] table may name one the group's
    # --device does not) picks the process group's backend and whether oneDNN needs its cap.
    device = next((getattr(p, "device", device) for s, p in processors if s == "train"), device)
    _cap_isa_before_any_kernel(processors, train_precision, device,
                               (artifacts_dir, run_name) if resume else None)
    world = distributed.setup(device)  # a single process unless torchrun started us
    try:
        # What a stage can check before any runs (report's --compare), against the folder
        # the run is in: --run may name a run folder's path elsewhere. A run the chain makes
        # is made after the checks, so that a refused chain leaves none behind.
        creates = processors[0][0] in CREATES_A_RUN and not resume
        if creates:
            _check(processors, Path(artifacts_dir))
        run = _the_run(processors, artifacts_dir, run_name, resume, world)
        if not creates:
            _check(processors, run.artifacts_dir)
        stages = " ".join(stage for stage, _ in processors)
        reads_only = all(stage in READS_ONLY for stage, _ in processors)
        with (lock.hold_run(run, stages) if world.is_main and not reads_only
              else contextlib.nullcontext()):
            for stage, process in processors:
                if stage not in EVERY_RANK and not world.is_main:
                    continue  # qat, quantize and report are single-process work for rank 0
                with (distributed.alone() if stage not in EVERY_RANK
                      else contextlib.nullcontext()):
                    seconds = _run_stage(run, stage, process,
                                         world.is_main and stage not in READS_ONLY)
                if world.is_main and not quiet and stage not in READS_ONLY:
                    click.echo(f"{stage}: done in {_duration(seconds)}", err=True)
    finally:
        distributed.teardown()


def _check_recommended_has_a_report(processors: list[Processor]) -> None:
    """predict or export of the recommended variant after a stage that makes variants needs
    the report of this chain before it: the run's report, if any, would recommend what that
    stage made again, and was refused only once training had run."""
    from stages.run.errors import UsageError

    for index, (stage, process) in enumerate(processors):
        before = [name for name, _ in processors[:index]]
        last = max((i for i, name in enumerate(before) if name in MAKES_VARIANTS), default=None)
        if getattr(process, "variant", None) == "recommended" and last is not None and (
                "report" not in before[last + 1:]):
            raise UsageError(f"{stage} of the recommended variant needs a report after "
                             f"{before[last]} in this chain: pipeline {' '.join(before)} report "
                             f"{stage} ..., or name a variant with --variant")


def _check(processors: list[Processor], artifacts_dir: Path) -> None:
    for _, process in processors:
        getattr(process, "check", lambda artifacts_dir: None)(artifacts_dir)


def _the_run(processors: list[Processor], artifacts_dir: Path, run_name: str | None,
             resume: bool, world):
    """The chain's run: a new one where the chain starts with train or import (not resumed),
    made by rank 0 for every rank; else the existing one, which fails before any work starts
    where it is missing."""
    from stages.run import artifacts
    from stages.training import distributed

    if processors[0][0] not in CREATES_A_RUN or resume:
        return artifacts.open_run(artifacts_dir, run_name)
    # Input that cannot work (a model that does not import, weights that are not weights) is
    # refused before a run folder exists or `latest` moves to it.
    getattr(processors[0][1], "preflight", lambda: None)()
    name = artifacts.create_run(artifacts_dir, run_name).name if world.is_main else None
    run = artifacts.Run(Path(artifacts_dir), distributed.broadcast(name))
    if world.is_main:
        click.echo(f"run {run.name}: {run.root}", err=True)
    return run


def _cap_isa_before_any_kernel(processors: list[Processor], precision: str | None, device: str,
                               resumed: tuple[Path, str | None] | None) -> None:
    """bf16 training on an AMX CPU needs oneDNN capped below AMX before its first kernel
    (stages/training/precision.py says why); this is the last moment before any runs. A
    resumed run (``resumed``: its artifacts folder and name) trains in the precision it was
    started with."""
    # What trains in this process: train, and qat or the QAT quantize --auto goes on to, each
    # in the precision its processor says (trains_in: qat's auto is fp32).
    others = [p.trains_in for _, p in processors if getattr(p, "trains_in", None)]
    if not others and not any(stage == "train" for stage, _ in processors):
        return
    from stages.training.precision import cap_isa_for_bf16_training

    precision = precision or "auto"
    if resumed:
        from stages.run.artifacts import open_run
        from stages.run.errors import UsageError

        try:
            run = open_run(*resumed)
        except UsageError:  # a missing run: run_chain reports it, with its own message
            run = None
        if run is not None:
            precision = run.recorded_config("train").get("resolved_precision", precision)
    trained = ([precision] if any(s == "train" for s, _ in processors) else []) + others
    capped = next(filter(None, (cap_isa_for_bf16_training(p, device) for p in trained)), None)
    if capped:
        click.echo(f"bf16 training (or, under --precision auto, timing it against fp32) on a "
                   f"CPU with AMX: oneDNN capped at {capped} in this "
                   "process (AMX bf16 kernels of this torch give wrong results); quantize and "
                   "the report run in a process of their own, without the cap", err=True)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _run_stage(run, stage: str, process: Callable, writes: bool) -> float:
    """Mark the stage running, then complete or failed, so that a run is never taken for
    complete when a stage died half-way; returns the seconds it took. Signals wait for each
    status write: in CI, torchrun's SIGTERM reached rank 0 while it wrote its own failure and
    left the stage `running`."""
    import time

    started, complete = time.perf_counter(), False
    try:
        if writes:  # inside the try: a signal held back during this write is delivered here
            with _status_write():
                run.mark_stage(stage, "running")
        process(run)
        seconds = time.perf_counter() - started
        if writes:  # inside too: a full disk here had left the stage `running`
            with _status_write():
                run.mark_stage(stage, "complete", seconds=round(seconds, 1))
                complete = True
    except BaseException as exc:
        if writes and not complete:
            _mark_failed(run, stage, exc)
        raise
    return seconds


def _mark_failed(run, stage: str, exc: BaseException) -> None:
    """Write the stage's failure even where a signal cuts the first try short: torchrun's
    SIGTERM, arriving with the error that made this rank fail, runs its handler (SystemExit)
    at the first Python call after the error, which can be before _status_write holds signals
    back; that handler leaves SIGTERM's default behind, so the second try is not cut short.
    The signal's exception is raised once the failure is on disk (a kill keeps its exit code),
    as is one held back during the write (delivered when _status_write ends)."""
    interrupted, written = None, False
    for _ in range(2):
        try:
            with _status_write():
                run.mark_stage(stage, "failed", f"{type(exc).__name__}: {exc}"[:500])
                written = True
            break
        except Exception:  # the disk may be what failed; the original error matters more
            break
        except BaseException as signalled:  # before the write began, or held back until after
            interrupted = signalled
            if written:
                break
    if interrupted is not None:
        raise interrupted


def _status_write():
    """What a stage's status write holds back: Ctrl-C, kill and torchrun, dying loader workers."""
    import signal

    from stages.run.signals import deferred

    return deferred(signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)

"""Does the report time each variant as it would run alone?

    .venv/bin/python benchmarks/isolation.py [--run NAME] [--artifacts-dir artifacts]
                                             [--batch-size 32] [--processes 5] [--seconds 3]

Times every variant of a run alone, each in a fresh process of its own: it loads the variant,
warms it up and times calls for about --seconds, nothing else running in the process. Every
variant gets --processes such processes, interleaved (one process per variant in turn, then
again), so that the machine's slow moments fall on all of them alike. Then it prints, for each
variant, the speed-up against the fastest float variant that the run's report measured (all
variants in one process, interleaved) beside the same ratio from the isolated processes: taken
round by round (a variant's process against the fastest float's process of the same round,
one round apart at most: about 2 minutes with 2-second processes on the default run here, so
that the machine's slower quarter-hours cancel), its median over the
rounds, and the range of the rounds, which is how far the isolated reference itself can be
trusted. The run needs a report (`pipeline report`). Nothing in the run folder is written.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(artifacts_dir: Path, run_name: str, variant: str, batch_size: int, seconds: float,
           threads: int) -> None:
    """One variant alone: load, warm up, time calls for ``seconds``; prints the call times."""
    import torch

    from stages import runtimes
    from stages.shared.artifacts import open_run
    from stages.shared.data import splits_of_run
    from stages.shared.timing import random_batch

    torch.set_num_threads(threads)
    run = open_run(artifacts_dir, run_name)
    loaded = runtimes.load(run, variant, threads)
    call = loaded.call_for(random_batch(splits_of_run(run).input_shape(batch_size)))
    for _ in range(3):
        call()
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(times) < 10:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    print(json.dumps(times))


def isolated_medians(args, variants: list[str], threads: int) -> dict[str, list[float]]:
    """Median call time (ms) of each process, per variant, processes interleaved."""
    medians: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.processes):
        order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
        for variant in order:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", variant, "--run", args.run_name,
                 "--artifacts-dir", str(args.artifacts_dir), "--batch-size",
                 str(args.batch_size), "--seconds", str(args.seconds), "--threads",
                 str(threads)], capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                sys.exit(f"{variant}: the worker failed: {proc.stderr.strip()[-500:]}")
            times = json.loads(proc.stdout.strip().splitlines()[-1])
            medians[variant].append(statistics.median(times) * 1000.0)
            print(f"  {variant}: process {round_ + 1}: {medians[variant][-1]:.2f} ms",
                  file=sys.stderr, flush=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", dest="run_name", default=None)
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--processes", type=int, default=5, help="per variant")
    parser.add_argument("--seconds", type=float, default=3.0, help="of timed calls per process")
    parser.add_argument("--threads", type=int, default=0, help="0: as the report used")
    parser.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.artifacts_dir, args.run_name, args.worker, args.batch_size, args.seconds,
               args.threads)
        return

    from stages.shared.artifacts import open_run

    run = open_run(args.artifacts_dir, args.run_name)
    args.run_name = run.name
    report = json.loads(run.verified_path("report/report.json").read_text())
    size = str(args.batch_size)
    rows = {m["name"]: m for m in report["models"] if size in m["latency_ms"]}
    if not rows:
        sys.exit(f"the report of run {run.name!r} did not time batch {size}; run "
                 f"'pipeline report --batch-sizes {size}' first")
    threads = args.threads or report["config"]["threads"]
    medians = isolated_medians(args, list(rows), threads)
    alone = {v: statistics.median(ms) for v, ms in medians.items()}
    floats = [v for v in rows if not rows[v]["int8"]]
    # Ratios against the float variant the report found fastest, so that both columns divide
    # by the same model; the fastest one alone is named too.
    fastest = next(iter(rows.values()))["speedup_vs_best_float"][size]["best_float"]
    print(f"run {run.name}, batch {size}, {threads} threads, "
          f"{report['environment']['cpu']['model']}; isolated: {args.processes} processes of "
          f"{args.seconds:g} s per variant")
    print(f"fastest float: {fastest} in the report, {min(floats, key=alone.get)} alone")
    print("| variant | report p50 ms | alone p50 ms | report vs fastest float | alone vs fastest "
          "float (rounds' range) | report / alone |")
    print("|---|---|---|---|---|---|")
    worst, spread = 0.0, 0.0
    for variant, row in rows.items():
        in_report = row["speedup_vs_best_float"][size]
        rounds = [f / v for f, v in zip(medians[fastest], medians[variant], strict=True)]
        ratio_alone = statistics.median(rounds)
        off = in_report["ratio"] / ratio_alone
        worst = max(worst, abs(off - 1.0))
        spread = max(spread, max(rounds) / min(rounds) - 1.0)
        print(f"| {variant} | {row['latency_ms'][size]['p50']:.2f} | {alone[variant]:.2f} | "
              f"{in_report['ratio']:.2f}x ({in_report['low']:.2f}-{in_report['high']:.2f}) | "
              f"{ratio_alone:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) | {off:.3f} |")
    print(f"largest difference between the report's ratio and the isolated one: {worst:.1%}")
    print(f"largest spread of one variant's isolated ratio across rounds (high/low): "
          f"{spread:.1%}")


if __name__ == "__main__":
    main()

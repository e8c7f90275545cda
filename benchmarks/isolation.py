"""Does the report time each variant as it would run alone?

    .venv/bin/python benchmarks/isolation.py [--run NAME] [--artifacts-dir artifacts]
                                             [--batch-size 32] [--processes 3]

Times every variant of a run alone, each in a process of its own, and sets the result beside
the report's (which times all variants in one process). Every variant gets a fresh worker
process that loads it and nothing else; the workers wait on a pipe, and this script drives them
through the report's own harness (timing.interleaved, with the report's warm-up, rounds, time
budget and interval target), one worker active at a time: it asks a worker for one call, timed
in the worker, and before each variant's round asks the worker that ran last to wait until its
threads are idle. So the isolated figures differ from the report's in one thing only, whether
the other variants share the process; the machine's slow moments fall on all variants alike,
as in the report, rather than on whichever process happened to run then (fresh processes timed
one after the other for seconds each spread by 1.4x to 1.6x on the 2-core machine here).

That is repeated with --processes fresh sets of workers, for the luck of one process (its
memory layout, where its threads land). For each variant it prints the report's speed-up
against the fastest float variant of the report beside the isolated one: the median over the
sets and the sets' range. The run needs a report (`pipeline report`); nothing in the run folder
is written.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def serve(artifacts_dir: Path, run_name: str, variant: str, batch_size: int,
          threads: int) -> None:
    """One variant alone in this process, answering the driver's commands on stdin: `call`
    (untimed), `time` (one call, its seconds), `idle` (wait until no thread of this process
    uses the CPU, the seconds waited), `quit`."""
    # Replies go to the original stdout; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch

    from stages import runtimes
    from stages.data.datasets import splits_of_run
    from stages.measure import timing
    from stages.run.artifacts import open_run

    torch.set_num_threads(threads)
    run = open_run(artifacts_dir, run_name)
    loaded = runtimes.load(run, variant, threads)
    call = loaded.call_for(timing.random_batch(splits_of_run(run).input_shape(batch_size)))
    replies.write("ready\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "call":
            call()
            replies.write("0\n")
        elif command == "time":
            started = time.perf_counter()
            call()
            replies.write(f"{time.perf_counter() - started!r}\n")
        elif command == "idle":
            replies.write(f"{timing.wait_until_idle()!r}\n")
        else:
            break


def start_workers(args, variants: list[str], threads: int, logs: Path) -> dict:
    """A fresh worker process per variant, each loaded and ready."""
    workers = {}
    for variant in variants:
        workers[variant] = subprocess.Popen(
            [sys.executable, __file__, "--serve", variant, "--run", args.run_name,
             "--artifacts-dir", str(args.artifacts_dir), "--batch-size", str(args.batch_size),
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=(logs / f"{variant}.log").open("w"), text=True, bufsize=1)
    for variant, worker in workers.items():
        if worker.stdout.readline().strip() != "ready":
            stop_workers(workers)
            error = (logs / f"{variant}.log").read_text().strip()[-800:]
            sys.exit(f"{variant}: the worker failed to load it: {error}")
    return workers


def stop_workers(workers: dict) -> None:
    for worker in workers.values():
        try:
            worker.stdin.write("quit\n")
            worker.stdin.close()
        except OSError:  # it has stopped already; its log says why
            pass
    for worker in workers.values():
        worker.wait(timeout=60)


def time_alone(workers: dict, config: dict, floats: set[str], logs: Path) -> dict:
    """The report's harness, run over the workers: each call made and timed in its own
    process, one process active at a time."""
    from stages.measure import timing

    active = [None]  # the worker that ran last, whose threads must be idle before the next

    def ask(variant: str, command: str) -> float:
        active[0] = variant
        workers[variant].stdin.write(command + "\n")
        reply = workers[variant].stdout.readline()
        if not reply:
            error = (logs / f"{variant}.log").read_text().strip()[-800:]
            sys.exit(f"{variant}: the worker stopped: {error}")
        return float(reply)

    def idle() -> float:
        return 0.0 if active[0] is None else ask(active[0], "idle")

    calls = {v: (lambda v=v: ask(v, "call")) for v in workers}
    timers = {v: (lambda _call, v=v: ask(v, "time")) for v in workers}
    return timing.interleaved(
        calls, config["rounds"], config["repeats"], config["warmup"],
        max_rounds=config["max_rounds"],
        done=timing.narrow_enough(floats, config["target_interval"]),
        budget_seconds=config["timing_budget"], idle=idle, timers=timers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", dest="run_name", default=None)
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh worker processes per variant, one set after another")
    parser.add_argument("--threads", type=int, default=0, help="0: as the report used")
    parser.add_argument("--serve", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.artifacts_dir, args.run_name, args.serve, args.batch_size, args.threads)
        return

    from stages.measure import timing
    from stages.run.artifacts import open_run

    run = open_run(args.artifacts_dir, args.run_name)
    args.run_name = run.name
    report = json.loads(run.verified_path("report/report.json").read_text())
    size = str(args.batch_size)
    rows = {m["name"]: m for m in report["models"]
            if size in m["latency_ms"] and m.get("device", "cpu") == "cpu"}
    if not rows:
        sys.exit(f"the report of run {run.name!r} did not time batch {size}; run "
                 f"'pipeline report --batch-sizes {size}' first")
    config, threads = report["config"], args.threads or report["config"]["threads"]
    floats = {v for v in rows if not rows[v]["int8"]}
    # Ratios against the float variant the report found fastest, so that both columns divide
    # by the same model; the fastest one alone is named too.
    fastest = next(iter(rows.values()))["speedup_vs_best_float"][size]["best_float"]
    ratios: dict[str, list[float]] = {v: [] for v in rows}
    p50s: dict[str, list[float]] = {v: [] for v in rows}
    widest = 1.0
    with tempfile.TemporaryDirectory() as logs:
        for set_ in range(args.processes):
            started = time.perf_counter()
            workers = start_workers(args, list(rows), threads, Path(logs))
            try:
                timings = time_alone(workers, config, floats, Path(logs))
            finally:
                stop_workers(workers)
            for variant, timed in timings.items():
                interval = timing.speedup(timings[fastest], timed)
                ratios[variant].append(interval["ratio"])
                widest = max(widest, interval["high"] / interval["low"])
                p50s[variant].append(timed.summary()["p50"])
            alone_fastest = min(floats, key=lambda v: p50s[v][-1])
            print(f"  set {set_ + 1} of {args.processes}: {time.perf_counter() - started:.0f} s, "
                  f"{timings[fastest].summary()['rounds']} rounds; fastest float alone: "
                  f"{alone_fastest}", file=sys.stderr, flush=True)

    print(f"run {run.name}, batch {size}, {threads} threads, "
          f"{report['environment']['cpu']['model']}; alone: {args.processes} fresh processes "
          f"per variant, driven through the report's harness")
    print("| variant | report p50 ms | alone p50 ms (sets) | report vs fastest float | alone vs "
          "fastest float (sets' range) | report / alone |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for variant, row in rows.items():
        in_report = row["speedup_vs_best_float"][size]
        alone = statistics.median(ratios[variant])
        off = in_report["ratio"] / alone
        worst = max(worst, abs(off - 1.0))
        p50 = ", ".join(f"{ms:.2f}" for ms in p50s[variant])
        print(f"| {variant} | {row['latency_ms'][size]['p50']:.2f} | {p50} | "
              f"{in_report['ratio']:.2f}x ({in_report['low']:.2f}-{in_report['high']:.2f}) | "
              f"{alone:.2f}x ({min(ratios[variant]):.2f}-{max(ratios[variant]):.2f}) | "
              f"{off:.3f} |")
    print(f"largest difference between the report's ratio and the isolated one: {worst:.1%}")
    print(f"widest isolated interval (high/low) of one set: {widest:.2f}x")


if __name__ == "__main__":
    main()

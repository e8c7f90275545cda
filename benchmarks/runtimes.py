"""Every variant of a run, timed the report's way, as the tables in docs/measurements.md.

    .venv/bin/python benchmarks/runtimes.py [--run NAME] [--artifacts-dir artifacts]
        [--rounds 8] [--repeats 4]

Re-measures the run (the latest by default) with the report's harness: one process, every
variant timed in each round with the order rotated, garbage collection off, the same number of
calls for each. Prints p50 latency at batch 1 and 32, test accuracy, and each variant's speed-up
against the reference eager (report.json's `reference`: amp, in bf16 where it trained so) and
against the fastest float variant at batch 32, with 95% intervals. The
run's own report/ files are left as they are: this writes its report to a scratch folder.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from pipeline.config import ReportConfig
from stages import report
from stages.run.artifacts import open_run


def table(result: dict) -> str:
    rows = ["| variant | p50 ms, batch 1 | p50 ms, batch 32 | test accuracy | vs reference @32 "
            "| vs best float @32 |", "|---|---|---|---|---|---|"]
    for model in result["models"]:
        latency = model["latency_ms"]
        vs_ref = model["speedup_vs_reference"]["32"]
        vs_best = model["speedup_vs_best_float"]["32"]
        rows.append(f"| {model['name']} | {latency['1']['p50']:.2f} | {latency['32']['p50']:.2f} "
                    f"| {model['accuracy']:.2%} "
                    f"| {vs_ref['ratio']:.2f}x ({vs_ref['low']:.2f}-{vs_ref['high']:.2f}) "
                    f"| {vs_best['ratio']:.2f}x ({vs_best['low']:.2f}-{vs_best['high']:.2f}) |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="run name (default: the latest)")
    parser.add_argument("--artifacts-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4, help="timed calls per round")
    parser.add_argument("--threads", type=int, default=0, help="0: the machine's cores, at most 8")
    args = parser.parse_args()
    original = open_run(args.artifacts_dir, args.run)
    with tempfile.TemporaryDirectory() as scratch:
        # A copy of the run, so the report written here does not replace the run's own.
        copy = Path(scratch) / "runs" / original.name
        shutil.copytree(original.root, copy, ignore=shutil.ignore_patterns("report"))
        run = open_run(Path(scratch), original.name)
        config = ReportConfig(batch_sizes=(1, 32), rounds=args.rounds, max_rounds=args.rounds,
                              repeats=args.repeats, threads=args.threads, quiet=True)
        result = report.run(config, run)
    env = result["environment"]
    print(f"run {original.name}: {env['cpu']['model']}, {result['config']['threads']} threads, "
          f"{args.rounds} rounds")
    print(table(result))
    verdict = result["verdict"]
    print(f"recommended: {verdict['recommended']} (chosen on {verdict['chosen_on']})")


if __name__ == "__main__":
    main()

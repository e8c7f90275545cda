"""`report --compare`: runs side by side, each from its own verified report.json."""
from __future__ import annotations

import json

from stages import runtimes
from stages.run.artifacts import Run
from stages.run.errors import UsageError


def compare_markdown(runs: list[Run]) -> tuple[dict, str]:
    """Side by side: every variant of every run, from each run's verified report.json."""
    table = {}
    for other in runs:
        try:
            path = other.verified_path("report/report.json")
        except UsageError:
            raise UsageError(f"run {other.name!r} has no report yet; run 'pipeline --run "
                             f"{other.name} report' first") from None
        table[other.name] = json.loads(path.read_text())
    present = [m["name"] for r in table.values() for m in r["models"]]
    # The fixed variants in their order, then the rows of other devices (`amp@cuda`).
    names = [v for v in runtimes.VARIANTS if v in present]
    names += [n for n in dict.fromkeys(present) if n not in names]
    lines = ["# Runs side by side", "", "| variant | " + " | ".join(f"`{n}`" for n in table) + " |",
             "|" + "---|" * (len(table) + 1)]
    for variant in names:
        cells = []
        for data in table.values():
            row = next((m for m in data["models"] if m["name"] == variant), None)
            big = str(data["config"]["batch_sizes"][-1])
            cells.append("-" if row is None else
                         f"{row['accuracy']:.2%}, {row['size_bytes'] / 1e6:.2f} MB, "
                         f"{row['latency_ms'][big]['p50']:.2f} ms @{big}")
        lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    lines += ["", "| run | recommended | at batch | vs reference | vs fastest float | size ratio | "
              "test change (points) |", "|---|---|---|---|---|---|---|"]
    for name, data in table.items():
        v = data["verdict"]
        lines.append(f"| `{name}` | `{v['recommended']}` | {v['batch_size']} | "
                     f"{v['speedup']:.2f}x | {v['speedup_vs_best_float']:.2f}x | "
                     f"{v['size_ratio']:.2f}x | {v['accuracy_change_points']:+.2f} |")
    lines += ["", "Each run's numbers come from its own report, measured when that report ran."]
    summary = {name: {"verdict": d["verdict"], "models": d["models"],
                      "environment": d["environment"]} for name, d in table.items()}
    return summary, "\n".join(lines) + "\n"

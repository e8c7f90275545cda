"""The report's figures as PNG files (matplotlib, Agg backend: no display needed).

Variants are told apart by a legend keyed by colour and marker rather than by labels beside
the points: labels of variants of the same size and speed print over each other.
"""
from __future__ import annotations

from pathlib import Path

from stages.report.recommendation import within_budget
from stages.run.files import atomic_path

RUNTIME_COLOURS = {"pytorch": "tab:blue", "onnx": "tab:orange", "openvino": "tab:green"}
MARKERS = "osD^vP*Xhp<>"


def _figure(width: float, height: float, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=110, squeeze=False)
    return plt, fig, list(axes[0])


def _save(plt, fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    plt.close(fig)


def pareto_front(points: list[tuple[float, float, str]]) -> list[str]:
    """Names of the points no other point beats on both coordinates (lower is better)."""
    front = []
    for x, y, name in points:
        beaten = any((ox <= x and oy <= y) and (ox < x or oy < y) for ox, oy, _ in points)
        if not beaten:
            front.append(name)
    return front


def _style(rows: list[dict]) -> dict[str, dict]:
    """A colour per runtime (one of its own for every GPU row, so that a GPU time is never read
    as a CPU one), a marker per variant, filled for float and hollow for int8."""
    styles = {}
    for i, row in enumerate(rows):
        colour = ("tab:purple" if row.get("device", "cpu") == "cuda"
                  else RUNTIME_COLOURS.get(row["format"], "tab:gray"))
        styles[row["name"]] = {"color": colour, "marker": MARKERS[i % len(MARKERS)],
                               "facecolors": "none" if row["int8"] else colour}
    return styles


def device_fronts(rows: list[dict], size: str) -> dict[str, list[tuple[float, float, str]]]:
    """Per device, its rows' Pareto front at batch ``size`` as (MB, p50 ms, name), smallest
    first: a GPU row, as large as its CPU twin and far faster, is no CPU variant's rival."""
    fronts = {}
    for device in dict.fromkeys(r.get("device", "cpu") for r in rows):
        points = [(r["size_bytes"] / 1e6, r["latency_ms"][size]["p50"], r["name"])
                  for r in rows if r.get("device", "cpu") == device]
        fronts[device] = sorted((p for p in points if p[2] in pareto_front(points)),
                                key=lambda p: p[0])
    return fronts


def latency_vs_size(rows: list[dict], path: Path) -> None:
    """One panel per batch size: shipped size against p50 latency, the Pareto front drawn."""
    sizes = list(rows[0]["latency_ms"])
    plt, fig, axes = _figure(5.2 * len(sizes) + 2.6, 4.6, ncols=len(sizes))
    styles = _style(rows)
    for ax, size in zip(axes, sizes):
        for device, front in device_fronts(rows, size).items():
            ax.plot([p[0] for p in front], [p[1] for p in front], color="black",
                    linewidth=0.8, linestyle="--" if device == "cpu" else ":", zorder=1,
                    label=f"Pareto front{'' if device == 'cpu' else ' on the GPU'} (nothing "
                          "on its device is smaller and faster)")
        for row in rows:
            style = styles[row["name"]]
            ax.scatter(row["size_bytes"] / 1e6, row["latency_ms"][size]["p50"], s=70,
                       marker=style["marker"], edgecolors=style["color"],
                       facecolors=style["facecolors"], linewidths=1.5, zorder=2,
                       label=f"{row['name']} ({row['accuracy']:.1%})")
        ax.set_xlabel("shipped size (MB)")
        ax.set_ylabel("p50 latency (ms, log scale)")
        ax.set_yscale("log")
        ax.set_title(f"batch {size}")
        ax.grid(True, alpha=0.3, which="both")
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               title="variant (test accuracy); hollow: int8", title_fontsize=8, frameon=False)
    fig.suptitle("Latency against size")
    fig.tight_layout()
    _save(plt, fig, path)


def speedup_styles(rows: list[dict], size: str, budget_points: float) -> list[dict]:
    """Each bar's look at batch ``size``: green faster than the fastest float beyond noise, red
    slower, grey within noise; a variant beyond the accuracy budget (which the report never
    recommends, however fast) hatched and unfilled, so that a fast int8 that lost accuracy is
    not drawn as a win."""
    styles = []
    for row in rows:
        x = row["speedup_vs_best_float"][size]
        colour = "tab:green" if x["low"] > 1 else "tab:red" if x["high"] < 1 else "tab:gray"
        beyond = not within_budget(row, budget_points)
        styles.append({"edgecolor": colour, "facecolor": "white" if beyond else colour,
                       "hatch": "///" if beyond else ""})
    return styles


def speedup_and_size(rows: list[dict], reference: str, path: Path,
                     budget_points: float) -> None:
    """Speed-up against the fastest float variant at each batch size, with its interval, and
    size against the reference: right of 1 is faster, left of 1 is smaller."""
    sizes = list(rows[0]["latency_ms"])
    ref = next(r for r in rows if r["name"] == reference)
    names = [r["name"] for r in rows]
    plt, fig, axes = _figure(4.2 * (len(sizes) + 1), 0.35 * len(rows) + 1.8,
                             ncols=len(sizes) + 1)
    for ax, size in zip(axes, sizes):
        ratios = [r["speedup_vs_best_float"][size] for r in rows]
        values = [x["ratio"] for x in ratios]
        errors = [[x["ratio"] - x["low"] for x in ratios], [x["high"] - x["ratio"] for x in ratios]]
        styles = speedup_styles(rows, size, budget_points)
        bars = ax.barh(names, values, xerr=errors, capsize=2)
        for bar, style in zip(bars, styles):
            bar.set(**style)
        ax.axvline(1.0, color="black", linewidth=0.8)
        for i, (v, x) in enumerate(zip(values, ratios)):  # beyond the whisker, not on it
            ax.text(max(v, x["high"]), i, f" {v:.2f}x", va="center", fontsize=7)
        ax.set_xlim(0, max(x["high"] for x in ratios) * 1.18)
        ax.set_title(f"speed-up vs fastest float on its device, batch {size}"
                     + ("\n(rows @cuda: on the GPU)" if any("@" in n for n in names) else "")
                     + ("\nhatched: beyond the accuracy budget, not recommended"
                        if any(s["hatch"] for s in styles) else ""), fontsize=9)
        ax.invert_yaxis()
    sizes_ratio = [r["size_bytes"] / ref["size_bytes"] for r in rows]
    ax = axes[-1]
    ax.barh(names, sizes_ratio, color=["tab:green" if v < 0.95 else "tab:gray"
                                       for v in sizes_ratio])
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, v in enumerate(sizes_ratio):
        ax.text(v, i, f" {v:.2f}x", va="center", fontsize=7)
    ax.set_xlim(0, max(sizes_ratio) * 1.18)
    ax.set_title(f"size vs {reference}", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    _save(plt, fig, path)


def training_curves(histories: dict[str, list[dict]], path: Path) -> None:
    """Loss, and training and validation accuracy, per epoch for each trained model."""
    plt, fig, (loss_ax, acc_ax) = _figure(10, 4, ncols=2)
    for name, history in histories.items():
        epochs = [h["epoch"] for h in history]
        line = loss_ax.plot(epochs, [h["loss"] for h in history], marker="o", label=name)[0]
        acc_ax.plot(epochs, [h["val_accuracy"] for h in history], marker="o",
                    color=line.get_color(), label=f"{name} validation")
        acc_ax.plot(epochs, [h["train_accuracy"] for h in history], linestyle=":", marker="x",
                    color=line.get_color(), label=f"{name} training")  # one epoch: a point
    loss_ax.set(title="training loss", xlabel="epoch", yscale="log")
    acc_ax.set(title="accuracy", xlabel="epoch")
    from matplotlib.ticker import MaxNLocator

    seen = [h["epoch"] for history in histories.values() for h in history]
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole epochs
        if seen:  # half an epoch either side: one epoch alone was ticked 0.945 to 1.05
            ax.set_xlim(min(seen) - 0.5, max(seen) + 0.5)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(plt, fig, path)


def lr_range(curve: dict, path: Path) -> None:
    """The learning-rate range test: smoothed loss against the learning rate (log scale), the
    steepest descent, the lowest loss, where it climbed past it and the value chosen marked."""
    plt, fig, (ax,) = _figure(6, 4)
    ax.plot(curve["lrs"], curve["losses"], color="tab:blue")
    capped = curve.get("capped")
    marks = (("steepest", ":", "steepest descent"), ("minimum", "--", "lowest loss"),
             ("climbed", "-.", f"{curve.get('climb', 1) - 1:.0%} above the lowest loss"),
             ("chosen", "-", "chosen peak, the batch's ceiling" if capped else "chosen peak"))
    for key, style, label in [mark for mark in marks if mark[0] in curve]:
        ax.axvline(curve[key], linestyle=style, color="tab:red" if key == "chosen" else "gray",
                   label=f"{label} {curve[key]:.3g}")
    ax.set(title="learning-rate range test", xlabel="learning rate", xscale="log",
           ylabel="training loss (smoothed)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(plt, fig, path)

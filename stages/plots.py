"""The report's figures as PNG files (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

from stages.artifacts import atomic_path


def _figure(width: float = 7.0, height: float = 4.5, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=110)
    return plt, fig, axes


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def latency_vs_size(rows: list[dict], batch: str, path: Path) -> None:
    """Each variant as a point: shipped size against p50 latency, labelled with its accuracy."""
    plt, fig, ax = _figure()
    for row in rows:
        x, y = row["size_bytes"] / 1e6, row["latency_ms"][batch]["p50"]
        ax.scatter(x, y, s=60)
        ax.annotate(f"{row['name']} ({row['accuracy']:.1%})", (x, y), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    ax.set_xlabel("shipped size (MB)")
    ax.set_ylabel(f"p50 latency at batch {batch} (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title("Latency against size (label: test accuracy)")
    ax.grid(True, alpha=0.3)
    _save(plt, fig, path)


def speedup_and_size(rows: list[dict], reference: str, batch: str, path: Path) -> None:
    """Bars of speed-up and size ratio against the reference: above 1 faster, below 1 smaller."""
    ref = next(r for r in rows if r["name"] == reference)
    names = [r["name"] for r in rows]
    speedups = [ref["latency_ms"][batch]["p50"] / r["latency_ms"][batch]["p50"] for r in rows]
    sizes = [r["size_bytes"] / ref["size_bytes"] for r in rows]
    plt, fig, (left, right) = _figure(width=10, height=4, ncols=2)
    for ax, values, title in ((left, speedups, f"speed-up vs {reference} at batch {batch}"),
                              (right, sizes, f"size vs {reference}")):
        better = (lambda v: v > 1.05) if ax is left else (lambda v: v < 0.95)
        worse = (lambda v: v < 0.95) if ax is left else (lambda v: v > 1.05)
        colors = ["tab:green" if better(v) else "tab:red" if worse(v) else "tab:gray"
                  for v in values]
        ax.barh(names, values, color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
        ax.set_title(title)
        ax.invert_yaxis()
    _save(plt, fig, path)


def training_curves(histories: dict[str, list[dict]], path: Path) -> None:
    """Loss and validation accuracy per epoch for each trained model (fp32 against amp)."""
    plt, fig, (loss_ax, acc_ax) = _figure(width=10, height=4, ncols=2)
    for name, history in histories.items():
        epochs = [h["epoch"] for h in history]
        loss_ax.plot(epochs, [h["loss"] for h in history], marker="o", label=name)
        acc_ax.plot(epochs, [h["val_accuracy"] for h in history], marker="o", label=name)
    loss_ax.set(title="training loss", xlabel="epoch", yscale="log")
    acc_ax.set(title="validation accuracy", xlabel="epoch")
    for ax in (loss_ax, acc_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    _save(plt, fig, path)

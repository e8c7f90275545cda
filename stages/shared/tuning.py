"""Choosing a static int8 configuration: score candidates on held-out training images, keep the
fastest within the accuracy budget, and where none meets it keep the most sensitive layers in
float until it does.

Backend-agnostic: a backend is a dict of plain functions (build a model for some options and
float layers, predict with it, make a call to time on a batch, list its layers). Candidates are
timed together by the report's own harness (timing.interleaved), so --auto ranks them the way
the report will. Nothing here sees the test split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Trial:
    """One quantized model made and scored: what it was made with and how it did."""

    options: dict
    float_layers: tuple[str, ...]
    model: Any
    val_accuracy: float
    drop_points: float  # accuracy lost against the float source, in points (negative: gained)
    logit_mse: float  # mean squared difference of logits from the float source's
    agreement: float
    latency_ms: float | None = None

    def summary(self) -> dict:
        return {"label": label(self.options), "options": self.options,
                "float_layers": list(self.float_layers),
                "val_accuracy": self.val_accuracy, "drop_points": self.drop_points,
                "logit_mse": self.logit_mse, "agreement": self.agreement,
                "latency_ms_p50": self.latency_ms}


def label(options: dict) -> str:
    """A short name for a configuration, for progress lines and the report."""
    parts = []
    for key, value in options.items():
        if key == "per_channel":
            parts.append("per-channel" if value else "per-tensor")
        elif key in ("types", "observer", "calibration_method", "format"):
            parts.append(str(value))
        elif key == "preset":
            parts.append(f"{value.lower()} preset")
        elif key == "weight_bits" and value != 8:
            parts.append(f"{value}-bit weights")
    return " ".join(parts)


# Candidates are timed at the report's default large batch, in a short interleaved session that
# stops once their speed-ups against the fastest candidate are known to within 10%.
TUNING_BATCH = 32
TUNING_TIMING = {"rounds": 4, "warmup": 2, "max_rounds": 12, "budget_seconds": 15.0}
TUNING_INTERVAL = 1.1


def score(backend: dict, options: dict, float_layers: tuple[str, ...], reference: dict) -> Trial:
    """Build one candidate and measure it against the float source on the validation images."""
    import torch

    model = backend["build"](options, float_layers)
    logits = backend["predict"](model, reference["images"])
    from stages.shared.evaluate import accuracy as exact_accuracy

    accuracy = exact_accuracy(logits, reference["labels"])
    return Trial(
        options=options, float_layers=tuple(float_layers), model=model, val_accuracy=accuracy,
        drop_points=(reference["accuracy"] - accuracy) * 100,
        logit_mse=float(torch.mean((logits - reference["logits"]) ** 2)),
        agreement=float((logits.argmax(1) == reference["logits"].argmax(1)).float().mean()))


def time_trials(backend: dict, trials: list[Trial], shape: tuple[int, ...]) -> None:
    """p50 latency of each trial, all timed in one interleaved session."""
    from stages.shared import timing

    batch = timing.random_batch((TUNING_BATCH, *shape))
    calls = {str(i): backend["call"](t.model, batch) for i, t in enumerate(trials)}
    timings = timing.interleaved(calls, **TUNING_TIMING,
                                 done=timing.narrow_enough(set(calls), TUNING_INTERVAL))
    for i, trial in enumerate(trials):
        trial.latency_ms = timings[str(i)].summary()["p50"]


def _within(trial: Trial, budget_points: float) -> bool:
    return trial.drop_points <= budget_points + 1e-9


def choose(trials: list[Trial], budget_points: float) -> tuple[Trial | None, str]:
    """The fastest trial within the budget (the only one, without timings), and why."""
    within = [t for t in trials if _within(t, budget_points)]
    if not within:
        return None, (f"none of {len(trials)} configuration(s) stayed within {budget_points:g} "
                      "point(s) of the float model on the validation images")
    if len(trials) == 1:
        return within[0], "the one configuration asked for is within the budget"
    best = min(within, key=lambda t: t.latency_ms)
    return best, (f"fastest ({best.latency_ms:.2f} ms) of {len(within)} configuration(s) within "
                  f"{budget_points:g} point(s) of the float model, of {len(trials)} tried")


# The greedy pass stops after this many layers in a row that brought the logits no closer:
# on mnasnet0_5 (53 layers, 6.7 points lost) it went on through every layer, about 6 minutes
# per backend, and still missed the budget.
FALLBACK_PATIENCE = 8


def keep_sensitive_layers_float(backend: dict, options: dict, layers: list[str], reference: dict,
                                budget_points: float,
                                say: Callable[[str], None] = lambda _: None) -> dict:
    """Rank layers by how much leaving each one alone in float brings the logits back, then keep
    the most sensitive in float, one more at a time, until the accuracy budget holds; the pass
    gives up after FALLBACK_PATIENCE layers in a row that do not help with those kept."""
    import time

    started = time.perf_counter()
    baseline = score(backend, options, (), reference)
    each = time.perf_counter() - started
    say(f"  ranking {len(layers)} layers: one model built and scored per layer, then one per "
        f"layer kept (this model took {each:.1f} s to build and score: about "
        f"{each * len(layers) / 60:.1f} min for the ranking)")
    gains = []
    for layer in layers:
        trial = score(backend, options, (layer,), reference)
        gains.append((baseline.logit_mse - trial.logit_mse, layer))
    ranked = sorted(gains, key=lambda g: -g[0])
    kept: list[str] = []
    trial, unhelpful = baseline, 0
    for _, layer in ranked:
        # A layer that does not help alone may still help with those kept (an outlier channel
        # and the convolution that reads it), so every layer stays a candidate until the
        # patience runs out.
        if _within(trial, budget_points) or unhelpful == FALLBACK_PATIENCE:
            break
        candidate = score(backend, options, tuple(kept + [layer]), reference)
        say(f"  float: {', '.join(kept + [layer])} -> {0.0 - candidate.drop_points:+.2f} points")
        # A layer joins the float set only if it brings the logits closer: one that helps
        # neither alone nor with the others would cost speed for nothing.
        if candidate.logit_mse < trial.logit_mse * 0.99:
            kept.append(layer)
            trial, unhelpful = candidate, 0
        else:
            unhelpful += 1
    if _within(trial, budget_points):
        stopped = "budget met"
    elif unhelpful == FALLBACK_PATIENCE:
        stopped = f"{FALLBACK_PATIENCE} layers in a row brought the logits no closer"
    else:
        stopped = "every layer was tried"
    say(f"  {len(kept)} layer(s) kept in float, {0.0 - trial.drop_points:+.2f} points: {stopped}")
    return {"trial": trial, "met_budget": _within(trial, budget_points), "stopped": stopped,
            "ranking": [{"layer": layer, "logit_mse_gain": gain} for gain, layer in ranked],
            "plain_drop_points": baseline.drop_points}


def tune(backend: dict, candidates: list[dict], reference: dict, budget_points: float,
         say: Callable[[str], None] = lambda _: None) -> tuple[Trial, dict]:
    """Score every candidate, keep the fastest within the budget (timed only when there is a
    choice); fall back to float layers if none meets it. Returns the chosen trial and a
    record of what was tried and why it won."""
    trials = [score(backend, options, (), reference) for options in candidates]
    if len(trials) > 1:
        time_trials(backend, trials, tuple(reference["images"].shape[1:]))
    for trial in trials:
        latency = f", {trial.latency_ms:.2f} ms" if trial.latency_ms is not None else ""
        say(f"  {label(trial.options)}: accuracy change {0.0 - trial.drop_points:+.2f} points"
            f"{latency}")
    chosen, why = choose(trials, budget_points)
    from stages.shared.machine import cpu_info

    # The defaults (7-bit weights without VNNI, u8s8) follow these; a model tuned here may
    # rank otherwise on a CPU without them.
    record = {"cpu_flags": cpu_info()["flags"], "budget_points": budget_points,
              "split": "held-out training images (validation split and images calibration "
                       "did not use)",
              "images": int(len(reference["labels"])),
              "tried": [t.summary() for t in trials]}
    if chosen is None:
        closest = min(trials, key=lambda t: t.drop_points)
        say(f"  {why}; keeping the most sensitive layers in float")
        fallback = keep_sensitive_layers_float(backend, closest.options, backend["layers"](),
                                               reference, budget_points, say)
        chosen = fallback.pop("trial")
        record["fallback"] = fallback | {"float_layers": list(chosen.float_layers)}
        why += (f"; kept {len(chosen.float_layers)} layer(s) in float: "
                + ("budget met" if fallback["met_budget"]
                   else f"budget still missed ({fallback['stopped']})"))
    record["chosen"] = chosen.summary()
    record["why"] = why
    return chosen, record

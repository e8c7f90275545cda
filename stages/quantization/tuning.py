"""Choosing a static int8 configuration: score candidates on held-out training images, keep the
fastest within the accuracy budget, and where none meets it keep the most sensitive layers in
float until it does. Within the budget means the held-out images show it at 95% confidence
(one-sided: the measured loss plus 1.645 standard errors of the paired change), so that a
candidate is not kept because its noise flattered it.

Runtime-agnostic: each runtime hands the search a Backend of plain functions (build a model for
some options and float layers, predict with it, make a call to time on a batch, list its layers
for some options). Candidates are timed together by the report's own harness
(timing.interleaved), so --auto ranks them the way the report will. Nothing here sees the test
split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Backend:
    """What the search asks of a runtime, as functions over its own models (an ONNX file, a
    PT2E graph, an OpenVINO model). Defined here, not in stages/runtimes/, because the search
    is what reads it and runtimes/ sits above quantization/ (tests/test_layers.py)."""

    build: Callable[[dict, tuple[str, ...]], Any]  # (options, float layers) -> a model
    predict: Callable[[Any, Any], Any]  # (model, images) -> logits, a float32 CPU tensor
    # (model, batch) -> a call to time; None where there is one configuration, nothing to rank
    call: Callable[[Any, Any], Callable[[], Any]] | None = None
    # options -> the layers that can stay float; None: no per-layer fallback (dynamic int8)
    layers: Callable[[dict], list[str]] | None = None
    # options -> each layer's own int8 error, in one pass; None: ranked by building a model
    # per layer (stages/quantization/sensitivity)
    errors: Callable[[dict], dict[str, float]] | None = None


@dataclass
class Trial:
    """One quantized model made and scored: what it was made with and how it did."""

    options: dict
    float_layers: tuple[str, ...]
    model: Any
    val_accuracy: float
    drop_points: float  # accuracy lost against the float source, in points (negative: gained)
    worst_drop_points: float  # what it may lose at worst, one-sided 95%: what the budget holds
    logit_mse: float  # mean squared difference of logits from the float source's
    agreement: float
    latency_ms: float | None = None

    def summary(self) -> dict:
        return {"label": label(self.options), "options": self.options,
                "float_layers": list(self.float_layers),
                "val_accuracy": self.val_accuracy, "drop_points": self.drop_points,
                "worst_drop_points": self.worst_drop_points,
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
        elif key == "equalize" and value:
            parts.append("equalized")
        elif key == "weight_bits" and value != 8:
            parts.append(f"{value}-bit weights")
        elif key == "float_depthwise" and value:
            parts.append("depthwise in float")
    return " ".join(parts) or "default"  # a variant made one way only (bf16 serving)


# Candidates are timed at the report's default large batch, in a short interleaved session that
# stops once their speed-ups against the fastest candidate are known to within 10%.
TUNING_BATCH = 32
TUNING_TIMING = {"rounds": 4, "warmup": 2, "max_rounds": 12, "budget_seconds": 15.0}
TUNING_INTERVAL = 1.1


def score(backend: Backend, options: dict, float_layers: tuple[str, ...],
          reference: dict) -> Trial:
    """Build one candidate and measure it against the float source on the held-out images."""
    import torch

    from stages.measure.evaluate import hit_share, top1_hits
    from stages.measure.stats import worst_change

    model = backend.build(options, float_layers)
    logits = backend.predict(model, reference["images"])
    hits = top1_hits(logits, reference["labels"])
    float_hits = top1_hits(reference["logits"], reference["labels"])
    accuracy = hit_share(hits)
    worst = worst_change(int((hits & ~float_hits).sum()), int((float_hits & ~hits).sum()),
                         len(hits))
    return Trial(
        options=options, float_layers=tuple(float_layers), model=model, val_accuracy=accuracy,
        drop_points=(reference["accuracy"] - accuracy) * 100, worst_drop_points=-worst * 100,
        logit_mse=float(torch.mean((logits - reference["logits"]) ** 2)),
        agreement=float((logits.argmax(1) == reference["logits"].argmax(1)).float().mean()))


def time_trials(backend: Backend, trials: list[Trial], shape: tuple[int, ...]) -> None:
    """p50 latency of each trial, all timed in one interleaved session."""
    from stages.measure import timing

    batch = timing.random_batch((TUNING_BATCH, *shape))
    calls = {str(i): backend.call(t.model, batch) for i, t in enumerate(trials)}
    timings = timing.interleaved(calls, **TUNING_TIMING,
                                 done=timing.narrow_enough(set(calls), TUNING_INTERVAL))
    for i, trial in enumerate(trials):
        trial.latency_ms = timings[str(i)].summary()["p50"]


def _within(trial: Trial, budget_points: float) -> bool:
    return trial.worst_drop_points <= budget_points + 1e-9


def choose(trials: list[Trial], budget_points: float) -> tuple[Trial | None, str]:
    """The fastest trial within the budget (the only one, without timings), and why."""
    within = [t for t in trials if _within(t, budget_points)]
    if not within:
        return None, (f"none of {len(trials)} configuration(s) stayed within {budget_points:g} "
                      "point(s) of the float model on the held-out images at 95% confidence")
    if len(trials) == 1:
        return within[0], "the one configuration asked for is within the budget"
    best = min(within, key=lambda t: t.latency_ms)
    return best, (f"fastest ({best.latency_ms:.2f} ms) of {len(within)} configuration(s) within "
                  f"{budget_points:g} point(s) of the float model, of {len(trials)} tried")


def _out_of_time(deadline: float | None) -> bool:
    import time

    return deadline is not None and time.monotonic() >= deadline


def _rank_by_building(backend: Backend, options: dict, layers: list[str], baseline: Trial,
                      reference: dict, say, deadline) -> list[tuple[float, str]]:
    """(gain, layer), each layer alone kept in float: one model built and scored per layer.
    What the fallback does where a backend's layers cannot be matched to the one-pass errors."""
    import time

    started = time.perf_counter()
    gains = []
    for layer in layers:
        if _out_of_time(deadline):
            break
        trial = score(backend, options, (layer,), reference)
        gains.append((baseline.logit_mse - trial.logit_mse, layer))
        if len(gains) == 1:
            each = time.perf_counter() - started
            say(f"  ranking {len(layers)} layers by building a model for each ({each:.1f} s "
                f"each here: about {each * len(layers) / 60:.1f} min)")
    return sorted(gains, key=lambda g: -g[0])


def _search_float_count(most: int, meets: Callable[[int], bool | None]) -> None:
    """Ask ``meets`` whether keeping the ``count`` most sensitive layers float meets the budget
    (None: no time left, stop): 1, 2, 4, ... up to ``most`` until one does, then halving the gap
    to the largest count that missed, so the fewest found takes about 2 log2(count) trials.
    Adding one layer at a time took one trial per layer: 20 per backend on resnet18 at 224x224,
    over 5 minutes for openvino-int8 alone, on a model that no count kept within the budget."""
    if most < 1:
        return
    missed, count = 0, 1
    while not (result := meets(count)):
        if result is None or count == most:
            return
        missed, count = count, min(count * 2, most)
    met = count
    while met - missed > 1:
        middle = (missed + met) // 2
        if (result := meets(middle)) is None:
            return
        met, missed = (middle, missed) if result else (met, middle)


def keep_sensitive_layers_float(backend: Backend, options: dict, layers: list[str],
                                reference: dict, budget_points: float,
                                say: Callable[[str], None] = lambda _: None,
                                errors: dict[str, float] | None = None,
                                deadline: float | None = None,
                                baseline: Trial | None = None) -> dict:
    """Keep the most sensitive of ``layers`` in float, as few as meet the accuracy budget. They
    are ranked by ``errors`` (each layer's own quantization error, measured in one pass:
    quantization/sensitivity.py) where given, else by building one model per layer; the
    fallback then tries the first 1, 2, 4, ... of the ranking and narrows down to the fewest
    that meet the budget (_search_float_count), stopping at ``deadline`` (time.monotonic()). Never
    every layer: that would be the float model. ``baseline``: the all-int8 trial for
    ``options`` where the search scored it: rebuilt, on efficientnet_b0 with 4,096 held-out
    images, the fallback tried 0 of 82 layers in what was left of a 3-minute --tuning-time."""
    if baseline is None:
        baseline = score(backend, options, (), reference)
    ranked = sorted(((error, layer) for layer, error in (errors or {}).items()
                     if layer in layers), key=lambda g: -g[0])
    if ranked:
        key = "error"
        method = "one pass: each layer's own quantization error on calibration images"
        say(f"  {len(ranked)} layers ranked in one pass by their own quantization error "
            f"(largest {ranked[0][1]}: {ranked[0][0]:.3g})")
    else:  # no errors, or none under the backend's layer names
        ranked = _rank_by_building(backend, options, layers, baseline, reference, say, deadline)
        method, key = "one model per layer, each alone kept in float", "logit_mse_gain"
    tried: dict[int, Trial] = {}

    def meets(count: int) -> bool | None:
        if _out_of_time(deadline):
            return None
        names = tuple(layer for _, layer in ranked[:count])
        tried[count] = trial = score(backend, options, names, reference)
        shown = ", ".join(names[:3]) + (f" and {count - 3} more" if count > 3 else "")
        say(f"  float: {shown} -> {0.0 - trial.drop_points:+.2f} points "
            f"(at worst {0.0 - trial.worst_drop_points:+.2f})")
        return _within(trial, budget_points)

    _search_float_count(min(len(ranked), len(layers) - 1), meets)
    met = [c for c, t in tried.items() if _within(t, budget_points)]
    trial = tried[min(met)] if met else min([baseline, *tried.values()],
                                            key=lambda t: t.worst_drop_points)
    stopped = _why_stopped(bool(met), deadline, (len(tried), len(ranked), len(layers)))
    say(f"  {'' if met else 'closest: '}{len(trial.float_layers)} layer(s) in float, "
        f"{0.0 - trial.drop_points:+.2f} points (at worst {0.0 - trial.worst_drop_points:+.2f}):"
        f" {stopped}")
    return {"trial": trial, "all_int8": baseline, "met_budget": bool(met),
            "stopped": stopped, "ranked_by": method, "float_counts_tried": list(tried),
            "ranking": [{"layer": layer, key: value} for value, layer in ranked],
            "plain_drop_points": baseline.drop_points}


def _why_stopped(met: bool, deadline: float | None, counts: tuple[int, int, int]) -> str:
    """Why the fallback stopped; ``counts``: trials made, layers ranked, layers that could
    stay float."""
    tried, ranked, layers = counts
    if met:
        return "budget met"
    if _out_of_time(deadline):
        return f"--tuning-time spent after {tried} trial(s)" + (
            f"; {layers - ranked} of {layers} layers not yet ranked" if ranked < layers else "")
    most = min(ranked, layers - 1)
    if most < 1:
        return "no layer can stay float without leaving nothing in int8"
    return (f"missed even with the {most} most sensitive of {layers} layers in float"
            + ("; all of them would be the float model" if most == layers - 1 else ""))


def tune(backend: Backend, candidates: list[dict], reference: dict, budget_points: float,
         say: Callable[[str], None] = lambda _: None,
         seconds: float | None = None) -> tuple[Trial | None, dict]:
    """Score every candidate, keep the fastest within the budget (timed only when there is a
    choice); fall back to float layers if none meets it and the backend lists its layers.
    ``seconds`` (--tuning-time) bounds the search: candidates and layers not reached in time
    are not tried, and the record says so. Returns the chosen trial, or None where nothing met
    the budget (the caller keeps nothing), and a record of what was tried and why."""
    import time

    deadline = time.monotonic() + seconds if seconds else None
    trials = []
    for options in candidates:
        if trials and _out_of_time(deadline):
            break
        trials.append(score(backend, options, (), reference))
    untried = [label(options) for options in candidates[len(trials):]]
    if len(trials) > 1:
        time_trials(backend, trials, tuple(reference["images"].shape[1:]))
    for trial in trials:
        latency = f", {trial.latency_ms:.2f} ms" if trial.latency_ms is not None else ""
        say(f"  {label(trial.options)}: accuracy change {0.0 - trial.drop_points:+.2f} points "
            f"(at worst {0.0 - trial.worst_drop_points:+.2f}){latency}")
    chosen, why = choose(trials, budget_points)
    from stages.measure.machine import cpu_info

    # The defaults (7-bit weights without VNNI, u8s8) follow these; a model tuned here may
    # rank otherwise on a CPU without them.
    record = {"cpu_flags": cpu_info()["flags"], "budget_points": budget_points,
              "split": "held-out training images (validation split and images calibration "
                       "did not use)",
              "images": int(len(reference["labels"])), "seconds_allowed": seconds,
              "tried": [t.summary() for t in trials], "not_tried": untried}
    if untried:
        why += f"; --tuning-time spent before {', '.join(untried)} could be tried"
    if chosen is None and backend.layers is None:  # dynamic int8: nothing to keep in float
        record["closest"] = min(trials, key=lambda t: t.worst_drop_points).summary()
    elif chosen is None and not _out_of_time(deadline):
        closest = min(trials, key=lambda t: t.worst_drop_points)
        say(f"  {why}; keeping the most sensitive layers in float")
        errors = backend.errors(closest.options) if backend.errors is not None else None
        fallback = keep_sensitive_layers_float(backend, closest.options,
                                               backend.layers(closest.options), reference,
                                               budget_points, say, errors, deadline,
                                               baseline=closest)
        found, all_int8 = fallback.pop("trial"), fallback.pop("all_int8")
        record["fallback"] = fallback | {"float_layers": list(found.float_layers)}
        if fallback["met_budget"]:
            chosen = found
            why += f"; kept {len(found.float_layers)} layer(s) in float: budget met"
            if found.float_layers:  # what the float layers cost, timed beside all-int8
                time_trials(backend, [all_int8, found], tuple(reference["images"].shape[1:]))
                record["fallback"]["latency_ms_all_int8"] = all_int8.latency_ms
        else:
            why += (f"; with {len(found.float_layers)} layer(s) in float still "
                    f"{0.0 - found.drop_points:+.2f} points, at worst "
                    f"{0.0 - found.worst_drop_points:+.2f} ({fallback['stopped']})")
            record["closest"] = found.summary()
    elif chosen is None:  # the candidates used the time: the fallback was never tried
        why += "; --tuning-time spent before layers could be kept in float"
    record["chosen"] = chosen.summary() if chosen is not None else None
    record["why"] = why
    return chosen, record

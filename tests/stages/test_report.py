import itertools
import json

import pytest

from stages import bench, report


def test_report_json_has_the_contract_fields(tiny_run):
    run, data = tiny_run["run"], tiny_run["report"]
    on_disk = json.loads((run.root / "report" / "report.json").read_text())
    assert on_disk["verdict"] == data["verdict"]
    names = [m["name"] for m in on_disk["models"]]
    assert names == ["fp32", "amp", "torch-dynamic", "torch-static", "onnx-fp32", "ort-dynamic",
                     "ort-static"]
    for model in on_disk["models"]:
        assert {"name", "format", "path", "size_bytes", "accuracy", "agreement",
                "latency_ms"} <= set(model)
        assert set(model["latency_ms"]) == {"1", "4"}
        for stats in model["latency_ms"].values():
            assert 0 < stats["p50"] <= stats["p90"]
    for name in ("fp32", "amp"):
        assert {"precision", "device", "seconds", "samples_per_second", "peak_memory_bytes",
                "checkpoint_bytes", "test_accuracy", "skipped_steps"} <= set(on_disk["training"][name])
    env = on_disk["environment"]
    assert {"torch", "torchvision", "onnx", "onnxruntime"} <= set(env["versions"])
    assert env["threads"] >= 1 and env["cpu"]["model"]


def test_report_numbers_agree_with_training_and_files(tiny_run):
    run, data = tiny_run["run"], tiny_run["report"]
    models = {m["name"]: m for m in data["models"]}
    # The report re-measures the saved fp32 model: it must match what training measured.
    assert models["fp32"]["accuracy"] == pytest.approx(tiny_run["train"]["fp32"].test_accuracy)
    assert models["fp32"]["agreement"] == 1.0 and models["fp32"]["flipped_predictions"] == 0
    assert models["torch-static"]["size_bytes"] == run.entry("torch-static")["bytes"]
    assert models["onnx-fp32"]["agreement"] >= 0.99 * models["amp"]["agreement"]


@pytest.mark.parametrize("figure", ["latency-vs-size.png", "speedup-and-size.png",
                                    "training-curves.png"])
def test_plots_are_real_pngs_embedded_in_the_report(tiny_run, figure):
    folder = tiny_run["run"].root / "report"
    png = (folder / figure).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert f"]({figure})" in (folder / "report.md").read_text()
    tiny_run["run"].verified_path(f"report/{figure}")


def test_accuracy_intervals_and_top5(tiny_run):
    for model in tiny_run["report"]["models"]:
        low, high = model["accuracy_ci95"]
        assert low < model["accuracy"] < high and high - low < 0.15  # 360 test images
        assert model["top5_accuracy"] >= model["accuracy"]
        change = model["accuracy_change_vs_reference"]
        assert change["low"] <= change["difference"] <= change["high"]


def test_latency_is_measured_on_random_inputs_of_the_real_shape(tiny_run, monkeypatch):
    from pipeline.config import ReportConfig

    shapes = []
    real_random_batch = bench.random_batch

    def spy(shape, seed=0):
        batch = real_random_batch(shape, seed)
        shapes.append(tuple(batch.shape))
        assert batch.dtype.is_floating_point and batch.std() > 0.5  # random, not zeros
        return batch

    monkeypatch.setattr(bench, "random_batch", spy)
    rows, _, _ = report.measure_variants(tiny_run["run"], ReportConfig(
        batch_sizes=(1, 3), warmup=0, repeats=3, quiet=True), threads=1)
    assert shapes == [(1, 1, 8, 8), (3, 1, 8, 8)] * len(rows)


def test_report_markdown_starts_with_the_verdict(tiny_run):
    folder = tiny_run["run"].root / "report"
    markdown = (folder / "report.md").read_text()
    assert markdown.startswith("# Report for run `tiny`")
    assert "**Ship `" in markdown and "| `ort-static` | onnx |" in markdown
    assert "master weights are fp32" in markdown


def test_summarize_percentiles_on_known_values():
    stats = bench.summarize([i / 1000 for i in range(1, 11)])  # 1..10 ms
    assert stats["p50"] == pytest.approx(5.5)
    assert stats["p90"] == pytest.approx(9.1)
    assert stats["min"] == 1 and stats["max"] == 10 and stats["repeats"] == 10


def test_measure_on_a_fake_clock_warms_up_and_stops_at_the_time_limit():
    ticks = itertools.count()
    calls = []
    clock = lambda: next(ticks) * 1.0  # every clock read advances one second  # noqa: E731
    stats = bench.measure(lambda: calls.append(1), warmup=2, repeats=50, max_seconds=5.5,
                          clock=clock)
    assert stats["p50"] == 1000.0  # each timed call spans one tick
    assert stats["repeats"] < 50 and len(calls) == 2 + stats["repeats"]


def _row(name, ms, accuracy, size=1.0):
    return {"name": name, "latency_ms": {"32": {"p50": ms}}, "accuracy": accuracy,
            "size_bytes": size}


def test_verdict_picks_the_fastest_variant_within_the_accuracy_budget():
    rows = [_row("fp32", 10.0, 0.98, 4.0), _row("torch-static", 2.0, 0.96, 1.0),
            _row("ort-static", 3.0, 0.975, 1.0), _row("ort-dynamic", 50.0, 0.98, 1.0)]
    v = report.verdict(rows, "fp32", budget_points=1.0, batch="32")
    assert v["recommended"] == "ort-static"
    assert v["speedup"] == pytest.approx(10 / 3) and v["size_ratio"] == 0.25
    assert report.verdict(rows, "fp32", budget_points=3.0, batch="32")["recommended"] == "torch-static"


def test_warnings_name_slow_int8_and_lost_accuracy():
    rows = [_row("fp32", 10.0, 0.98), _row("amp", 10.0, 0.98), _row("onnx-fp32", 5.0, 0.98),
            _row("ort-dynamic", 50.0, 0.98), _row("torch-static", 2.0, 0.95)]
    found = report.warnings_for(rows, "fp32", 1.0, "32")
    assert len(found) == 2
    assert "ort-dynamic is slower" in found[0] and "ConvInteger" in found[0]
    assert "torch-static loses 3.00 points" in found[1]


def test_report_shows_int8_op_counts_and_parity(tiny_run):
    data = tiny_run["report"]
    models = {m["name"]: m for m in data["models"]}
    assert models["torch-static"]["op_counts"]["Conv"] == {"int8": 3, "float": 0}
    assert models["torch-dynamic"]["op_counts"]["Conv"] == {"int8": 0, "float": 3}
    assert models["fp32"]["op_counts"]["Linear"] == {"int8": 0, "float": 1}
    pairs = {(p["a"], p["b"]): p for p in data["parity"]}
    assert set(pairs) >= {("amp", "torch-static"), ("onnx-fp32", "ort-static"),
                          ("torch-static", "ort-static"), ("amp", "onnx-fp32")}
    assert pairs[("amp", "onnx-fp32")]["max_abs_diff"] < 1e-3
    markdown = (tiny_run["run"].root / "report" / "report.md").read_text()
    assert "## Quantization" in markdown and "| `torch-static` | Conv 3/3 int8" in markdown
    assert "`ort-static` vs `torch-static`" in markdown

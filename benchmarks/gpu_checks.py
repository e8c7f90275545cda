"""The checks that need a GPU, in one go: run it on a CUDA machine.

    .venv/bin/python benchmarks/gpu_checks.py [--out DIR] [--checks NAME,...]

1. amp_speed_and_memory: AMP against fp32 on resnet18 at 224x224 (the digits, upsampled):
   training samples per second (AMP at least 1.5x fp32's) and the allocator's peak memory of
   each (AMP's lower), from one `pipeline train` run (both models, same seed and data order);
   the same training in bfloat16 beside it, for the numbers.
2. amp_serving_against_fp32: the report's GPU rows for that run at batch 64: `amp@cuda`
   (float16 autocast, as trained) faster than `fp32@cuda` eager (the 95% interval above 1;
   fp32's convolutions run in TF32, so this is no 2x: 1.26x on an H200), with a lower
   allocator peak and top-1 agreement with fp32 of at least 99.5%.
3. default_chain: `pipeline train quantize report` with training on CUDA: its report has the
   GPU rows and a GPU recommendation beside the CPU one.
4. deterministic: `--deterministic` on CUDA: two runs end with the same weights.
5. cpu_bf16_resumed_on_cuda: a run started in bf16 on the CPU and resumed on CUDA keeps bf16.
6. serving_memory_format: resnet18 eager at batch 64 in NCHW and channels_last, fp32 and
   float16, which the GPU rows' layout rests on.
7. ddp: two-GPU DDP through torchrun, where there are two GPUs; and one rank that fails makes
   every rank exit non-zero promptly.

Each check prints one line (PASS/FAIL and its numbers); all of them go to DIR/gpu_checks.json,
written after each check. Exit status 1 if any check failed. docs/measurements.md, GPU, has
the figures of the last run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = [sys.executable, "-m", "pipeline"]


def sh(args: list[str], env: dict | None = None, timeout: int = 1800) -> tuple[int, str, float]:
    started = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | (env or {}))
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - started


def manifest(artifacts: Path, run: str) -> dict:
    return json.loads((artifacts / "runs" / run / "manifest.json").read_text())


def training_results(artifacts: Path, run: str) -> dict:
    """The train stage's per-model results as the report reads them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from stages.run.artifacts import open_run

    opened = open_run(artifacts, run)
    return {name: opened.entry(name).get("training", {}) for name in ("fp32", "amp")
            if name in opened.artifacts()}


def amp_speed_and_memory(artifacts: Path) -> dict:
    code, out, seconds = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "amp224",
                                        "--device", "cuda", "--quiet", "train", "--model",
                                        "resnet18", "--image-size", "224", "--epochs", "10",
                                        "--batch-size", "128"])
    if code != 0:
        return {"ok": False, "error": out[-2000:]}
    results = training_results(artifacts, "amp224")
    fp32, amp = results["fp32"], results["amp"]
    # The same training in bfloat16 (no GradScaler), to tell whether auto's float16 on CUDA is
    # still the right default on a GPU that has both.
    code, out, _ = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "bf16-224",
                                  "--device", "cuda", "--quiet", "train", "--model", "resnet18",
                                  "--image-size", "224", "--epochs", "10", "--batch-size", "128",
                                  "--precision", "bf16", "--no-baseline"])
    bf16 = training_results(artifacts, "bf16-224")["amp"] if code == 0 else {"error": out[-800:]}
    return {"ok": amp["samples_per_second"] >= 1.5 * fp32["samples_per_second"]
            and amp["peak_memory_bytes"] < fp32["peak_memory_bytes"],
            "precision": amp.get("precision"), "seconds": seconds,
            "bf16": {key: bf16.get(key) for key in ("samples_per_second", "peak_memory_bytes",
                                                    "val_accuracy", "test_accuracy", "error")},
            "fp32_test_accuracy": fp32.get("test_accuracy"),
            "amp_test_accuracy": amp.get("test_accuracy"),
            "fp32_samples_per_second": fp32["samples_per_second"],
            "amp_samples_per_second": amp["samples_per_second"],
            "speedup": amp["samples_per_second"] / fp32["samples_per_second"],
            "fp32_peak_memory_mb": fp32["peak_memory_bytes"] / 1e6,
            "amp_peak_memory_mb": amp["peak_memory_bytes"] / 1e6}


def deterministic(artifacts: Path) -> dict:
    digests = []
    for name in ("det-a", "det-b"):
        code, out, _ = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", name,
                                      "--device", "cuda", "--quiet", "train", "--epochs", "2",
                                      "--no-baseline", "--deterministic"])
        if code != 0:
            return {"ok": False, "error": out[-2000:]}
        digests.append(manifest(artifacts, name)["artifacts"]["amp"]["sha256"])
    return {"ok": digests[0] == digests[1], "sha256": digests}


def cpu_bf16_resumed_on_cuda(artifacts: Path) -> dict:
    """Start in bf16 on the CPU, kill it once a checkpoint is listed, resume on CUDA."""
    args = PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "moved", "--device", "cpu",
                       "--quiet", "train", "--epochs", "3", "--no-baseline", "--precision",
                       "bf16", "--checkpoint-every", "5", "--no-measure-memory"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        path = artifacts / "runs" / "moved" / "manifest.json"
        if path.is_file() and '"amp/checkpoint-step' in path.read_text():
            break
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    code, out, _ = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "moved",
                                  "--device", "cuda", "--quiet", "train", "--resume"])
    if code != 0:
        return {"ok": False, "error": out[-2000:]}
    result = training_results(artifacts, "moved")["amp"]
    return {"ok": result.get("precision") == "bf16" and result.get("resumed_from") is not None,
            "precision_after_resume": result.get("precision"),
            "device_after_resume": result.get("device"), "resumed_from": result.get("resumed_from")}


def default_chain(artifacts: Path) -> dict:
    code, out, seconds = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "chain",
                                        "--device", "cuda", "train", "quantize", "report"])
    report = artifacts / "runs" / "chain" / "report" / "report.json"
    if code != 0 or not report.is_file():
        return {"ok": False, "error": out[-2000:]}
    data = json.loads(report.read_text())
    gpu_rows = [m["name"] for m in data["models"] if m.get("device") == "cuda"]
    return {"ok": {"fp32@cuda", "amp@cuda", "fp32-compiled@cuda"} <= set(gpu_rows)
            and data["verdict"].get("gpu") is not None, "seconds": seconds,
            "recommended_cpu": data["verdict"]["recommended"],
            "recommended_gpu": (data["verdict"].get("gpu") or {}).get("recommended"),
            "gpu_rows": gpu_rows, "gpu_note": data["environment"].get("gpu_note"),
            "training": {k: {"precision": v.get("precision"),
                             "samples_per_second": v.get("samples_per_second")}
                         for k, v in data["training"].items()}}


def amp_serving_against_fp32(artifacts: Path) -> dict:
    """The report's GPU rows for the 224x224 resnet18 of amp_speed_and_memory, at batch 64:
    amp served in float16 against fp32 eager, latency, allocator peak and top-1 agreement."""
    if not (artifacts / "runs" / "amp224").is_dir():
        return {"ok": False, "error": "amp_speed_and_memory did not leave its run"}
    code, out, seconds = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "amp224",
                                        "--device", "cuda", "--quiet", "report",
                                        "--batch-sizes", "64"])
    if code != 0:
        return {"ok": False, "error": out[-2000:]}
    data = json.loads((artifacts / "runs" / "amp224" / "report" / "report.json").read_text())
    rows = {m["name"]: m for m in data["models"]}
    if not {"fp32@cuda", "amp@cuda"} <= set(rows):
        return {"ok": False, "error": f"no GPU rows: {data['environment'].get('gpu_note')}"}
    fp32, amp = rows["fp32@cuda"], rows["amp@cuda"]
    speedup = fp32["latency_ms"]["64"]["p50"] / amp["latency_ms"]["64"]["p50"]
    return {"ok": amp["speedup_vs_reference"]["64"]["low"] > 1.0 and amp["agreement"] >= 0.995
            and amp["peak_gpu_memory_bytes"] < fp32["peak_gpu_memory_bytes"],
            "seconds": seconds, "amp_serving": amp["serving"],
            "fp32_p50_ms": fp32["latency_ms"]["64"]["p50"],
            "amp_p50_ms": amp["latency_ms"]["64"]["p50"], "speedup": speedup,
            "speedup_interval": amp["speedup_vs_reference"]["64"],
            "agreement_with_fp32": amp["agreement"],
            "fp32_peak_mb": fp32["peak_gpu_memory_bytes"] / 1e6,
            "amp_peak_mb": amp["peak_gpu_memory_bytes"] / 1e6}


def serving_memory_format(artifacts: Path) -> dict:
    """resnet18 at 224x224, batch 64, eager on the GPU: milliseconds a call (CUDA events,
    median of 50 after 10 warm-ups) in fp32 and under float16 autocast, NCHW against
    channels_last; the GPU rows serve channels_last, the layout training uses on CUDA."""
    import torch
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).cuda().eval()
    images = torch.randn(64, 3, 224, 224, device="cuda")
    times = {}
    for layout in ("nchw", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        model = model.to(memory_format=fmt)
        batch = images.contiguous(memory_format=fmt)
        for precision in ("fp32", "fp16"):
            context = (torch.autocast("cuda", dtype=torch.float16) if precision == "fp16"
                       else torch.autocast("cuda", enabled=False))
            samples = []
            with torch.inference_mode(), context:
                for step in range(60):
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    model(batch)
                    end.record()
                    torch.cuda.synchronize()
                    if step >= 10:
                        samples.append(start.elapsed_time(end))
            times[f"{precision}_{layout}_ms"] = sorted(samples)[len(samples) // 2]
    return {"ok": times["fp16_channels_last_ms"] <= times["fp16_nchw_ms"], **times}


def ddp(artifacts: Path) -> dict:
    import torch

    if torch.cuda.device_count() < 2:
        return {"ok": None, "skipped": f"{torch.cuda.device_count()} GPU(s); DDP needs two"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", "-m", "pipeline"]
    code, out, seconds = sh(torchrun + ["--artifacts-dir", str(artifacts), "--quiet",
                                        "train", "--epochs", "2"], env={"PIPELINE_RUN": "ddp"})
    if code != 0:
        return {"ok": False, "error": out[-2000:]}
    world = training_results(artifacts, "ddp")["amp"].get("world_size")
    # One rank raises in its third forward pass: every rank must exit non-zero, promptly.
    started = time.perf_counter()
    failed, _, _ = sh(torchrun + ["--artifacts-dir", str(artifacts), "--quiet", "train",
                                  "--model", "tests.pipeline.failing_rank:net", "--image-size",
                                  "8", "--epochs", "1", "--no-baseline"],
                      env={"PIPELINE_RUN": "ddp-fail", "PYTHONPATH": os.pathsep.join(
                          filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
                      timeout=600)
    return {"ok": world == 2 and failed != 0, "world_size": world, "seconds": seconds,
            "one_rank_failing_exit": failed,
            "one_rank_failing_seconds": time.perf_counter() - started}




CHECKS = {check.__name__: check for check in (
    amp_speed_and_memory, amp_serving_against_fp32, default_chain, deterministic,
    cpu_bf16_resumed_on_cuda, serving_memory_format, ddp)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help="comma-separated, in this order (default: all)")
    args = parser.parse_args()
    names = args.checks.split(",")
    if unknown := sorted(set(names) - set(CHECKS)):
        sys.exit(f"gpu_checks: no check named {', '.join(unknown)}; there are {', '.join(CHECKS)}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_checks: no CUDA device here; run this on a machine with a GPU")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        artifacts = Path(scratch) / "artifacts"
        for name in names:
            started = time.perf_counter()
            try:
                results[name] = CHECKS[name](artifacts)
            except Exception as exc:  # one broken check must not hide the others' numbers
                results[name] = {"ok": False, "error": repr(exc)}
            outcome = results[name]
            outcome["check_seconds"] = round(time.perf_counter() - started, 1)
            word = {True: "PASS", False: "FAIL", None: "SKIP"}[outcome["ok"]]
            print(f"{word} {name}: "
                  f"{json.dumps({k: v for k, v in outcome.items() if k != 'ok'})[:600]}",
                  flush=True)
            # Written after every check: a call stopped at its time limit keeps what ran.
            (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=2))
        for run in ("chain", "amp224"):  # the reports themselves, to read beside the numbers
            report = artifacts / "runs" / run / "report" / "report.md"
            if report.is_file():
                (args.out / f"{run}-report.md").write_text(report.read_text())
    sys.exit(1 if any(isinstance(v, dict) and v.get("ok") is False
                      for v in results.values()) else 0)


if __name__ == "__main__":
    main()

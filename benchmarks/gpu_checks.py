"""The checks that need a GPU, in one go: run it on a CUDA machine.

    .venv/bin/python benchmarks/gpu_checks.py [--out DIR]

1. AMP against fp32 on resnet18 at 224x224 (the digits, upsampled): training samples per second
   (AMP at least 1.5x fp32's) and the allocator's peak memory of each (AMP's lower), from one
   `pipeline train` run (both models, same seed and data order).
2. The report's GPU rows for that run at batch 64: `amp@cuda` (float16, as trained) at least
   1.5x faster than `fp32@cuda` eager, with a lower allocator peak and top-1 agreement with fp32
   of at least 99.5%.
3. `--deterministic` on CUDA: two runs of the same configuration end with the same weights.
4. A run started in bf16 on the CPU and resumed on CUDA keeps bf16 (what it was started with).
5. The default chain, `pipeline train quantize report`, with training on CUDA: its report has
   the GPU rows and a GPU recommendation beside the CPU one.
6. Two-GPU DDP through torchrun, where there are two GPUs; and one rank that fails makes every
   rank exit non-zero promptly.

Each check prints one line (PASS/FAIL and its numbers); all of them go to DIR/gpu_checks.json.
Exit status 1 if any check failed.
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
    return {name: opened.entry(name).get("training", {}) for name in ("fp32", "amp")}


def amp_speed_and_memory(artifacts: Path) -> dict:
    code, out, seconds = sh(PIPELINE + ["--artifacts-dir", str(artifacts), "--run", "amp224",
                                        "--device", "cuda", "--quiet", "train", "--model",
                                        "resnet18", "--image-size", "224", "--epochs", "2",
                                        "--batch-size", "128"])
    if code != 0:
        return {"ok": False, "error": out[-2000:]}
    results = training_results(artifacts, "amp224")
    fp32, amp = results["fp32"], results["amp"]
    return {"ok": amp["samples_per_second"] >= 1.5 * fp32["samples_per_second"]
            and amp["peak_memory_bytes"] < fp32["peak_memory_bytes"],
            "precision": amp.get("precision"), "seconds": seconds,
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
    return {"ok": speedup >= 1.5 and amp["agreement"] >= 0.995
            and amp["peak_gpu_memory_bytes"] < fp32["peak_gpu_memory_bytes"],
            "seconds": seconds, "amp_serving": amp["serving"],
            "fp32_p50_ms": fp32["latency_ms"]["64"]["p50"],
            "amp_p50_ms": amp["latency_ms"]["64"]["p50"], "speedup": speedup,
            "speedup_interval": amp["speedup_vs_reference"]["64"],
            "agreement_with_fp32": amp["agreement"],
            "fp32_peak_mb": fp32["peak_gpu_memory_bytes"] / 1e6,
            "amp_peak_mb": amp["peak_gpu_memory_bytes"] / 1e6}


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
                      env={"PIPELINE_RUN": "ddp-fail", "PYTHONPATH": str(ROOT)},
                      timeout=600)
    return {"ok": world == 2 and failed != 0, "world_size": world, "seconds": seconds,
            "one_rank_failing_exit": failed,
            "one_rank_failing_seconds": time.perf_counter() - started}




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_checks: no CUDA device here; run this on a machine with a GPU")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as scratch:
        artifacts = Path(scratch) / "artifacts"
        for check in (amp_speed_and_memory, amp_serving_against_fp32, deterministic,
                      cpu_bf16_resumed_on_cuda, default_chain, ddp):
            try:
                results[check.__name__] = check(artifacts)
            except Exception as exc:  # one broken check must not hide the others' numbers
                results[check.__name__] = {"ok": False, "error": repr(exc)}
            outcome = results[check.__name__]
            word = {True: "PASS", False: "FAIL", None: "SKIP"}[outcome["ok"]]
            print(f"{word} {check.__name__}: "
                  f"{json.dumps({k: v for k, v in outcome.items() if k != 'ok'})[:400]}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=2))
    sys.exit(1 if any(isinstance(v, dict) and v.get("ok") is False
                      for v in results.values()) else 0)


if __name__ == "__main__":
    main()

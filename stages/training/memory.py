"""Peak memory of a block of work: CUDA's allocator peak, or growth of resident memory on CPU;
and a model's training memory on the CPU, measured in a fresh process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict

from stages.data.datasets import load_splits
from stages.run.progress import say
from stages.training.loop import DeviceSums, build_parts, train_step
from stages.training.precision import Precision

# The first step allocates gradients and SGD momentum; later ones reuse them: resnet18 on the
# digits peaked within 0.3% after 3 steps as after 8, in 6.3 to 6.6 s of probe, not 9.1 to 9.2.
MEMORY_PROBE_STEPS = 3


class PeakMemory:
    """Context manager; ``peak`` is in bytes once the block ends.

    On CPU the process high-water mark (ru_maxrss) never goes down, so the second model trained
    in one process would inherit the first one's peak: /proc/self/statm is sampled, and the
    high-water mark is used only when this block raised it (as it does in a fresh process).
    """

    def __init__(self, device):
        self.device = device
        self.peak = 0
        self.method = ("cuda max_memory_allocated" if device.type == "cuda"
                       else "growth of resident memory (RSS) during training")
        self._stop = threading.Event()
        self._start = 0

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    @staticmethod
    def _high_water() -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss() - self._start)

    def __enter__(self) -> "PeakMemory":
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._start = self._rss()
            self._high_water_start = self._high_water()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss() - self._start, 0)
            # Sampling can miss a short peak; the process's high-water mark cannot. It says
            # something about this block only if the block raised it.
            high_water = self._high_water()
            if high_water > self._high_water_start:
                self.peak = max(self.peak, high_water - self._start)


def peak_memory_in_fresh_process(config, precision: Precision) -> tuple[int, str]:
    """Peak growth of resident memory over a few training steps, each model in a process of
    its own: measured inside one process, the second model would inherit the first one's
    warm heap and look smaller than it is."""
    probe = json.dumps({"config": asdict(config), "precision": precision.name})
    # glibc raises its mmap threshold as a process frees large blocks, after which freed
    # activations stay in the heap and count as resident: two probes of one model differed by
    # up to 25%. A fixed threshold returns every large block on free, so RSS follows the live
    # tensors and repeated probes mostly agreed within 0.1% on the AMD EPYC (once 14% apart, in a
    # CI run).
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    try:
        proc = subprocess.run([sys.executable, "-m", "stages.training.memory", "--memory-probe",
                               probe], capture_output=True, text=True, timeout=900, env=env)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-300:])
        peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    except (subprocess.TimeoutExpired, RuntimeError, ValueError, LookupError) as error:
        # A figure for the report, not the training: its probe failing costs the figure only.
        say(f"warning: the memory probe failed ({str(error)[-300:]}); no memory figure")
        return 0, "not measured (the probe failed)"
    return peak, (f"peak growth of resident memory (RSS) over {MEMORY_PROBE_STEPS} training "
                  "steps, measured in a fresh process for each model with glibc's mmap "
                  "threshold fixed, so that freed tensors leave resident memory")


def _memory_probe(argument: str) -> None:
    from types import SimpleNamespace

    import torch

    probe = json.loads(argument)
    config = SimpleNamespace(**probe["config"])
    precision = Precision(probe["precision"])
    device = torch.device("cpu")
    splits = load_splits(config)
    parts = build_parts(config, splits, precision, device)
    parts.trained.train()
    parts.sampler.set_epoch(1)
    batches = iter(parts.loader)
    sums = DeviceSums(device)
    with PeakMemory(device) as memory:
        for step, (images, labels) in zip(range(MEMORY_PROBE_STEPS), batches):
            train_step(parts, precision, device, config.grad_clip, images, labels, sums, step)
    print(json.dumps({"peak": int(memory.peak)}))


if __name__ == "__main__" and sys.argv[1:2] == ["--memory-probe"]:
    _memory_probe(sys.argv[2])

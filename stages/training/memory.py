"""Peak memory of a block of work: CUDA's allocator peak, or growth of resident memory on CPU."""
from __future__ import annotations

import os
import threading


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

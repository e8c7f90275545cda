"""The machine a measurement ran on: CPU model and flags, the kernels' ISA, versions, GPU."""
from __future__ import annotations

import math
import os
import platform
from pathlib import Path

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
             "asimddp")


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on: a container's or taskset's, not the host's."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


CGROUP = Path("/sys/fs/cgroup")


def cpu_quota() -> float | None:
    """The CPUs a cgroup's quota allows this process (docker --cpus 2, a Kubernetes limit),
    which its affinity does not show: cgroup v2's cpu.max, else v1's CFS files; None where
    there is no quota."""
    try:
        quota, period = (CGROUP / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (CGROUP / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (CGROUP / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def inference_threads(asked: int | None = 0) -> int:
    """The threads a variant runs with: as asked, or one per CPU this process may run on (a
    taskset or a container's cpuset leaves fewer than the machine has, and a CPU quota may
    allow fewer still: more threads than the quota's CPUs use it up early in each CFS
    period and wait out the rest; not measured here, where no quota is set),
    capped at 8 (more seldom help one call and crowd everything else)."""
    if asked:
        return asked
    quota = cpu_quota()
    usable = len(allowed_cpus()) if quota is None else min(len(allowed_cpus()),
                                                             max(1, math.ceil(quota)))
    return min(usable, 8)


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags],
            "cores": os.cpu_count()}


def cpu_has_vnni() -> bool:
    """VNNI (AVX-512, AVX or AMX) multiplies uint8 by int8 without saturating; without it,
    int8 kernels need one operand of 7 bits (the weights, here) to stay exact."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_info()["flags"]))


def cpu_has_bf16() -> bool:
    """bf16 instructions (AVX-512 BF16, AMX): elsewhere bf16 is emulated, slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["flags"]))


def isa() -> dict:
    """What the kernels may use: ATen's vector ISA, and oneDNN's cap where one is set."""
    import torch

    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "not capped")}


def environment(threads: int) -> dict:
    import torch

    from stages.run.artifacts import versions

    return {"versions": versions(), "device": "cpu", "cpu": cpu_info(), "isa": isa(),
            "threads": threads, "cuda_available": torch.cuda.is_available(),
            "platform": platform.platform()}

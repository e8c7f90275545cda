"""A busy machine is noticed: the cores other processes used while a batch size was timed,
read from /proc/stat, and the spread of each variant's rounds. A simulated machine stands in
for /proc/stat and the clocks, so nothing here depends on what else runs on this one."""
import math

import pytest

from stages.measure import contention, timing


class Box:
    """A machine of ``cpus`` CPUs on a simulated clock: this process's CPU time, and what
    /proc/stat counts on the CPUs (this process's busy time plus others'). ``others`` are
    spells (start, end, cores) during which other processes keep that many cores busy."""

    def __init__(self, others=(), cpus: int = 2) -> None:
        self.now, self.own_cpu, self.cpus = 0.0, 0.0, cpus
        self.others = list(others)
        self.stat_reads = 0

    def _others_seconds(self, until: float) -> float:
        return sum(cores * max(0.0, min(end, until) - start)
                   for start, end, cores in self.others)

    def run(self, seconds: float, own_cores: float) -> None:
        self.now += seconds
        self.own_cpu += seconds * own_cores

    def stat(self, cpus) -> tuple[float, float]:
        assert list(cpus) == list(range(self.cpus))
        self.stat_reads += 1
        return self.own_cpu + self._others_seconds(self.now), 0.01 * self.now

    def meter(self) -> contention.Meter:
        return contention.Meter(cpus=range(self.cpus), stat=self.stat, own=lambda: self.own_cpu,
                                clock=lambda: self.now, sleep=lambda s: self.run(s, 0.0),
                                load=lambda: 1.5)


def _steady(ms: float = 2.0) -> timing.Timing:
    return timing.Timing([[ms / 1000] * 5 for _ in range(5)])


def _session(box: Box, seconds: float = 1.0, results=None, warmup: float = 0.0):
    """A timing session: ``warmup`` seconds of first calls, then rounds that keep both threads
    of this process busy for ``seconds``; each run returns the next of ``results`` (default:
    two steady variants)."""
    results = iter(results or [])

    def session(begin):
        box.run(warmup, own_cores=1.0)
        begin()
        box.run(seconds, own_cores=2.0)
        return next(results, {"fp32": _steady(4.0), "onnx-fp32": _steady(2.0)})

    return session


def test_a_quiet_machine_is_timed_once_and_called_clean():
    box = Box(others=[(0.0, 100.0, 0.02)])
    watch = contention.Watch(threads=2, meter=box.meter())
    timings = watch.time("cpu", 32, _session(box))
    assert set(timings) == {"fp32", "onnx-fp32"}
    record = watch.record()
    assert record["clean"]
    assert (record["cpus"], record["threads"], record["spare_cpus"]) == (2, 2, 0)
    [session] = record["sessions"]
    assert (session["device"], session["batch_size"], session["tries"]) == ("cpu", 32, 1)
    assert session["others_cores"] == pytest.approx(0.02)
    assert session["steal_cores"] == pytest.approx(0.01)
    assert session["load_average_1m"] == [1.5, 1.5]
    assert not session["busy"] and session["unstable"] == {} and session["clean"]
    assert contention.warnings(record) == []


def test_one_busy_core_beside_a_two_thread_session_is_timed_again_and_marked_busy():
    box = Box(others=[(0.0, 100.0, 1.0)])
    watch = contention.Watch(threads=2, meter=box.meter())
    watch.time("cpu", 1, _session(box))
    record = watch.record()
    [session] = record["sessions"]
    assert session["tries"] == 1 + contention.RETRIES
    assert session["others_cores_per_try"] == [pytest.approx(1.0)] * (1 + contention.RETRIES)
    # Before timing again it waited for the core to come free, and gave up at the bound.
    assert session["waited_seconds"] == pytest.approx(contention.QUIET_MAX_WAIT)
    assert session["busy"] and not session["clean"] and not record["clean"]
    [warning] = contention.warnings(record)
    assert warning.startswith("Other processes used 1.00 cores on average while the variants "
                              "were timed at batch 1 on the CPU in each of 2 tries (this "
                              "report's 2 threads on 2 CPUs leave 0 spare; more than 0.25 is a "
                              "busy machine).")
    assert "not clean figures" in warning


def test_a_burst_that_ends_is_waited_out_and_the_quiet_try_kept():
    box = Box(others=[(0.0, 1.6, 1.0)])  # busy through the first try and a little after
    watch = contention.Watch(threads=2, meter=box.meter())
    first = {"fp32": _steady(8.0), "onnx-fp32": _steady(4.0)}
    second = {"fp32": _steady(4.0), "onnx-fp32": _steady(2.0)}
    timings = watch.time("cpu", 32, _session(box, results=[first, second]))
    assert timings is second
    [session] = watch.record()["sessions"]
    assert session["tries"] == 2 and session["clean"] and watch.record()["clean"]
    assert session["others_cores_per_try"] == [pytest.approx(1.0), pytest.approx(0.0)]
    assert session["waited_seconds"] == pytest.approx(1.0)  # two windows: busy, then quiet


def test_what_runs_during_the_warm_up_calls_is_not_counted():
    """A first call that compiles keeps torch.compile's worker processes (other processes, this
    report's work) busy before the rounds begin: only the rounds are judged."""
    box = Box(others=[(0.0, 3.0, 2.0)])  # compile workers on both CPUs while warming up
    watch = contention.Watch(threads=2, meter=box.meter())
    watch.time("cpu", 1, _session(box, warmup=3.0))
    [session] = watch.record()["sessions"]
    assert session["clean"] and session["tries"] == 1
    assert session["others_cores"] == pytest.approx(0.0)
    assert session["seconds"] == pytest.approx(1.0)


def test_others_may_use_the_cpus_the_session_leaves_spare():
    """One thread on two CPUs leaves one to others: a busy core beside it takes nothing."""
    box = Box(others=[(0.0, 100.0, 1.0)])
    watch = contention.Watch(threads=1, meter=box.meter())
    watch.time("cpu", 1, _session(box))
    assert watch.allowed_others == 1 + contention.OTHERS_CORES_MARGIN
    assert watch.record()["clean"] and watch.record()["sessions"][0]["tries"] == 1


def test_a_short_session_is_judged_over_a_window_long_enough_for_the_ticks():
    box = Box(others=[(0.0, 100.0, 1.0)])
    meter = box.meter()
    _, usage = meter.watch(_session(box, seconds=0.05))
    assert usage["seconds"] == pytest.approx(contention.MIN_WINDOW)
    assert usage["others_cores"] == pytest.approx(1.0)


def test_a_variant_whose_rounds_spread_is_unstable_and_timed_again():
    box = Box(others=[(0.0, 100.0, 0.02)])
    watch = contention.Watch(threads=2, meter=box.meter())
    # Half the rounds three times slower: something took the machine for them.
    spread = timing.Timing([[0.002] * 5, [0.006] * 5, [0.002] * 5, [0.006] * 5, [0.002] * 5,
                            [0.006] * 5])
    unsteady = {"fp32": _steady(4.0), "onnx-fp32": spread}
    steady = {"fp32": _steady(4.0), "onnx-fp32": _steady(2.0)}
    timings = watch.time("cpu", 32, _session(box, results=[unsteady, steady]))
    assert timings is steady and watch.record()["sessions"][0]["tries"] == 2

    always = contention.Watch(threads=2, meter=box.meter())
    always.time("cpu", 32, _session(box, results=[unsteady, unsteady]))
    [session] = always.record()["sessions"]
    assert not session["busy"] and session["unstable"] == {"onnx-fp32": pytest.approx(3.0)}
    assert not session["clean"] and not always.record()["clean"]
    [warning] = contention.warnings(always.record())
    assert warning.startswith("The rounds of `onnx-fp32` 3.00x at batch 32 on the CPU varied "
                              "more than 2x between their slower and faster quarters")


def test_the_verdict_marks_each_batch_size_by_its_own_session():
    record = {"sessions": [{"device": "cpu", "batch_size": 1, "clean": False},
                           {"device": "cpu", "batch_size": 32, "clean": True},
                           {"device": "cuda", "batch_size": 1, "clean": True}]}
    cpu = contention.mark_verdict({"per_batch_size": {"1": {}, "32": {}}}, record, "cpu")
    assert cpu == {"per_batch_size": {"1": {"timing_clean": False}, "32": {"timing_clean": True}},
                   "timing_clean": False}
    gpu = contention.mark_verdict({"per_batch_size": {"1": {}}}, record, "cuda")
    assert gpu["timing_clean"] and gpu["per_batch_size"]["1"]["timing_clean"]


def test_proc_stat_counts_busy_and_stolen_time_on_the_cpus_given(tmp_path):
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 90 900 9000 90 9 9 90 0 0\n"
                    "cpu0 100 10 200 1000 50 1 2 30 0 0\n"
                    "cpu1 300 20 400 2000 10 3 4 20 0 0\n"
                    "cpu2 500 60 300 6000 30 5 3 40 0 0\n"
                    "intr 123 0 0\nctxt 456\n")
    tick = __import__("os").sysconf("SC_CLK_TCK")
    busy, steal = contention.proc_stat_seconds([0, 2], path=str(stat))
    assert busy == pytest.approx((100 + 10 + 200 + 1 + 2 + 500 + 60 + 300 + 5 + 3) / tick)
    assert steal == pytest.approx((30 + 40) / tick)
    assert contention.proc_stat_seconds([0], path=str(tmp_path / "missing")) is None
    # A CPU the file does not list (lxcfs numbers them otherwise): the sum would undercount.
    assert contention.proc_stat_seconds([0, 5], path=str(stat)) is None


def test_without_proc_stat_clean_is_unknown_and_the_spread_alone_is_judged():
    """Without /proc/stat's lines for these CPUs a steady load beside the rounds would go
    unseen: clean is unknown (None) for the session, the record and the verdict, never true,
    and report.md says so; unsteady rounds still make it false."""
    box = Box(others=[(0.0, 100.0, 1.0)])  # a busy core, unseen
    meter = contention.Meter(cpus=[0, 1], stat=lambda cpus: None, own=lambda: box.own_cpu,
                             clock=lambda: box.now, sleep=lambda s: box.run(s, 0.0),
                             load=lambda: None)
    watch = contention.Watch(threads=2, meter=meter)
    watch.time("cpu", 1, _session(box))
    record = watch.record()
    [session] = record["sessions"]
    assert session["others_cores"] is None and session["busy"] is None
    assert session["clean"] is None and record["clean"] is None and session["tries"] == 1
    assert contention.warnings(record) == []
    verdict = contention.mark_verdict({"per_batch_size": {"1": {}}}, record, "cpu")
    assert verdict["timing_clean"] is None
    assert verdict["per_batch_size"]["1"]["timing_clean"] is None
    assert contention.all_clean([None, False, True]) is False
    assert contention.all_clean([True, True]) is True
    assert contention.quiet_sentence(record) == (
        " The load of other processes could not be read (no /proc/stat line for these CPUs), so "
        "a busy machine would go unnoticed.")
    [caveat, _] = contention.caveat(record)
    assert caveat.startswith("**Whether the machine was quiet while timing is unknown:**")

    spread = timing.Timing([[0.002] * 5, [0.006] * 5] * 3)
    unsteady = contention.Watch(threads=2, meter=meter)
    unsteady.time("cpu", 1, _session(box, results=[{"fp32": spread}] * 2))
    assert unsteady.record()["sessions"][0]["clean"] is False
    assert unsteady.record()["clean"] is False


def test_a_variant_timed_while_its_process_never_went_idle_is_not_clean():
    """A pool in this process that spins on after each call (OMP_WAIT_POLICY=ACTIVE): the wait
    before its calls gives up at IDLE_MAX_WAIT, and the session says so rather than clean."""
    box = Box(others=[(0.0, 100.0, 0.02)])
    spinning = _steady(2.0)
    spinning.idle_waits = [0.001, timing.IDLE_MAX_WAIT + 0.001]
    quiet = _steady(4.0)
    quiet.idle_waits = [0.001, 0.002]
    # Not timed again: a quieter machine would not change this process's own threads.
    watch = contention.Watch(threads=2, meter=box.meter(), retries=2)
    watch.time("cpu", 32, _session(box, results=[{"fp32": quiet, "onnx-fp32": spinning}]))
    record = watch.record()
    [session] = record["sessions"]
    assert session["never_idle"] == ["onnx-fp32"] and not session["clean"]
    assert session["tries"] == 1
    assert contention.warnings(record) == [
        "`onnx-fp32` at batch 32 on the CPU was timed while other threads of this process still "
        "used the CPU (the wait for them gave up). These latencies and speed-ups are not clean "
        "figures: they may include that work."]
    [caveat, _] = contention.caveat(record)  # report.md had sent the user to a quiet machine
    assert caveat.startswith("**Timed beside this process's own busy threads: these latencies")
    assert "quiet machine" not in caveat and "unsteady" not in caveat


def test_variants_run_with_a_thread_per_cpu_the_process_may_use():
    """A taskset or a container's cpuset leaves a process fewer CPUs than the machine has: the
    default thread count follows them (os.cpu_count() does not), and --threads wins."""
    import os
    import subprocess
    import sys

    first = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{first}}}); "
            "from stages.measure.machine import inference_threads as t; print(t(), t(3))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["1", "3"]


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2: docker --cpus 1.5
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None)])
def test_a_cgroup_cpu_quota_bounds_the_threads_as_the_affinity_does(tmp_path, monkeypatch,
                                                                     files, quota):
    """docker --cpus or a Kubernetes limit leaves every CPU in the affinity mask; the quota
    alone says how many CPUs the threads may use."""
    from stages.measure import machine

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(machine, "CGROUP", tmp_path)
    monkeypatch.setattr(machine, "allowed_cpus", lambda: list(range(64)))
    assert machine.cpu_quota() == quota
    assert machine.inference_threads() == (8 if quota is None else math.ceil(quota))
    assert machine.inference_threads(3) == 3

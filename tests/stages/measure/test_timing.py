"""The latency harness: a variant is timed only once the threads another left spinning are
quiet, rounds hold as many calls as fill them, and rounds go on until the intervals are narrow.
A simulated clock stands in for the machine, so nothing here depends on real timings."""
import pytest

from stages.measure import timing


class Machine:
    """A simulated process: a clock, the CPU time of all its threads, and a runtime (A) whose
    pool keeps one core busy for ``spin`` seconds after each call. A call of B takes 2 ms,
    twice that while A's pool spins (two cores, one taken)."""

    def __init__(self, spin: float) -> None:
        self.now, self.main_cpu, self.spin = 0.0, 0.0, spin
        self.spins: list[list[float]] = []  # [start, end] of each spell of spinning

    def clock(self) -> float:
        return self.now

    def cpu(self) -> float:
        spun = sum(max(0.0, min(end, self.now) - start) for start, end in self.spins)
        return self.main_cpu + spun

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def _work(self, seconds: float) -> None:
        self.now += seconds
        self.main_cpu += seconds

    def call_a(self) -> None:
        self._work(0.003)
        if self.spins and self.spins[-1][1] >= self.now - 0.003:
            self.spins[-1][1] = self.now + self.spin
        else:
            self.spins.append([self.now, self.now + self.spin])

    def call_b(self) -> None:
        spinning = any(start <= self.now < end for start, end in self.spins)
        self._work(0.004 if spinning else 0.002)

    def idle(self) -> float:
        return timing.wait_until_idle(cpu=self.cpu, clock=self.clock, sleep=self.sleep)


def _time_both(machine: Machine, idle) -> dict:
    timings = timing.interleaved({"a": machine.call_a, "b": machine.call_b}, rounds=6,
                                 repeats=5, warmup=1, clock=machine.clock, idle=idle)
    return {name: t.summary() for name, t in timings.items()}


def test_a_variant_is_timed_only_once_the_threads_left_spinning_are_quiet():
    machine = Machine(spin=0.030)
    measured = _time_both(machine, machine.idle)
    assert measured["b"]["p50"] == pytest.approx(2.0)  # B's time alone, in ms
    assert measured["b"]["p90"] == pytest.approx(2.0)
    assert 25.0 <= measured["b"]["idle_wait_ms_max"] <= 40.0  # it waited for A's pool


def test_without_waiting_for_idle_the_spinning_pool_slows_the_next_variant():
    """The control: the simulated machine does slow B down when nothing waits."""
    machine = Machine(spin=0.030)
    measured = _time_both(machine, lambda: 0.0)
    assert measured["b"]["p50"] == pytest.approx(4.0)


def test_waiting_gives_up_at_its_limit_when_something_never_stops():
    machine = Machine(spin=1000.0)
    machine.call_a()
    waited = timing.wait_until_idle(max_wait=0.5, cpu=machine.cpu, clock=machine.clock,
                                    sleep=machine.sleep)
    assert 0.5 <= waited < 0.51


def test_a_round_holds_as_many_calls_as_fill_it():
    assert timing.calls_per_round(0.002) == 25
    assert timing.calls_per_round(0.0001) == timing.MAX_CALLS_PER_ROUND
    assert timing.calls_per_round(0.150) == 1


def test_adaptive_rounds_go_on_until_even_a_slow_variant_has_calls_for_a_p90():
    clock = [0.0]
    slow = Noisy(clock, 0.150, [1.0])
    fast = Noisy(clock, 0.002, [1.0])
    timings = timing.interleaved({"slow": slow, "fast": fast}, rounds=5, warmup=1,
                                 max_rounds=40, done=timing.narrow_enough({"slow"}, 1.1),
                                 clock=lambda: clock[0], idle=lambda: 0.0)
    assert [len(r) for r in timings["slow"].rounds] == [1] * timing.MIN_CALLS
    assert timings["fast"].summary()["calls"] == 25 * timing.MIN_CALLS
    # The slow variant's calls need no untimed call first; the fast one's do.
    assert slow.calls == 1 + 1 + timing.MIN_CALLS and fast.calls == 2 + 26 * timing.MIN_CALLS


class Noisy:
    """A call whose duration in round r is base x factors[r % len(factors)], on a fake clock."""

    def __init__(self, clock: list, base: float, factors: list[float]) -> None:
        self.clock, self.base, self.factors, self.calls = clock, base, factors, 0

    def __call__(self) -> None:
        self.calls += 1
        self.clock[0] += self.base * self.factors[(self.calls // 100) % len(self.factors)]


def _adaptive(factors_b, max_rounds=30, budget=None):
    clock = [0.0]
    calls = {"float": Noisy(clock, 0.004, [1.0]), "int8": Noisy(clock, 0.002, factors_b)}
    return timing.interleaved(calls, rounds=5, repeats=100, warmup=0, max_rounds=max_rounds,
                              done=timing.narrow_enough({"float"}, 1.1),
                              budget_seconds=budget, clock=lambda: clock[0], idle=lambda: 0.0)


def test_rounds_stop_as_soon_as_every_interval_is_narrow_enough():
    steady = _adaptive([1.0])
    assert len(steady["int8"].rounds) == 5  # the minimum: the interval is exactly 2.0-2.0
    noisy = _adaptive([1.0, 1.6, 0.7, 1.3])  # rounds disagree by far more than 10%
    assert len(noisy["int8"].rounds) == 30
    budgeted = _adaptive([1.0, 1.6, 0.7, 1.3], budget=4.0)  # a round takes 0.6 s
    assert len(budgeted["int8"].rounds) == 7


def test_a_variant_far_slower_than_the_fastest_float_needs_no_narrow_interval():
    def rounds_of(base: float) -> int:
        clock = [0.0]
        calls = {"float": Noisy(clock, 0.002, [1.0]),
                 "other": Noisy(clock, base, [1.0, 1.6, 0.7, 1.3])}
        timings = timing.interleaved(calls, rounds=5, repeats=100, warmup=0, max_rounds=30,
                                     done=timing.narrow_enough({"float"}, 1.1),
                                     clock=lambda: clock[0], idle=lambda: 0.0)
        return len(timings["other"].rounds)

    assert rounds_of(0.008) == 5  # 0.25x, give or take its noise: settled at the minimum
    assert rounds_of(0.0021) == 30  # near the fastest float its interval must narrow


def test_speedup_is_a_ratio_of_medians_with_an_interval_over_rounds():
    slow = timing.Timing([[0.004] * 5 for _ in range(6)])
    fast = timing.Timing([[0.002] * 5 for _ in range(6)])
    assert timing.speedup(slow, fast) == {"ratio": pytest.approx(2.0), "low": pytest.approx(2.0),
                                          "high": pytest.approx(2.0)}
    varied = timing.Timing([[0.002 * f] * 5 for f in (0.8, 1.0, 1.2, 0.9, 1.1, 1.0)])
    interval = timing.speedup(slow, varied)
    assert interval["low"] < 2.0 < interval["high"] and interval["ratio"] == pytest.approx(2.0)
    assert not timing.within_noise(interval) and timing.within_noise(timing.speedup(fast, varied))


class FakeGpu:
    """A GPU on a clock of its own: a call queues kernels that take ``ms`` of GPU time and
    returns at once (as CUDA launches do); events read the GPU clock when the queue reaches
    them, and synchronizing waits for the queue."""

    def __init__(self) -> None:
        self.queue_ends = 0.0  # GPU time at which everything queued so far is done
        self.synchronized = 0

    def launch(self, ms: float):
        def call():
            self.queue_ends += ms

        return call

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.at = gpu.queue_ends

            def synchronize(self):
                gpu.synchronized += 1

            def elapsed_time(self, other):
                return other.at - self.at

        return Event()


def test_gpu_calls_are_timed_by_cuda_events_not_by_the_host_clock():
    gpu = FakeGpu()
    host = [0.0]
    timings = timing.interleaved(
        {"fp16": gpu.launch(2.0), "fp32": gpu.launch(5.0)}, rounds=5, repeats=4, warmup=1,
        clock=lambda: host[0], idle=lambda: 0.0,
        timers={name: timing.cuda_timer(gpu.event) for name in ("fp16", "fp32")})
    assert timings["fp16"].summary()["p50"] == pytest.approx(2.0)  # ms, the kernels' own
    assert timings["fp32"].summary()["p50"] == pytest.approx(5.0)
    assert gpu.synchronized == 2 * (1 + 5 * 4)  # every timed call waited for its kernels
    assert timing.speedup(timings["fp32"], timings["fp16"])["ratio"] == pytest.approx(2.5)


def test_round_spread_is_the_upper_over_the_lower_quartile_of_the_rounds_medians():
    steady = timing.Timing([[0.002, 0.003, 0.002]] * 6)
    assert steady.round_spread() == pytest.approx(1.0)
    # One slow round of eight moves neither quartile; a quarter of them slow moves the upper.
    one_slow = timing.Timing([[0.002] * 3] * 7 + [[0.020] * 3])
    assert one_slow.round_spread() == pytest.approx(1.0)
    half_slow = timing.Timing([[0.002] * 3, [0.006] * 3] * 4)
    assert half_slow.round_spread() == pytest.approx(3.0)
    assert half_slow.summary()["round_spread"] == pytest.approx(3.0)
    assert timing.Timing([[0.002] * 3]).round_spread() == 1.0  # one round: nothing to compare


def test_begin_is_called_after_the_warm_up_calls_and_before_the_first_round():
    events = []
    timing.interleaved({"a": lambda: events.append("call")}, rounds=3, repeats=2, warmup=2,
                       idle=lambda: 0.0, begin=lambda: events.append("begin"))
    # Two warm-up calls and one to size the rounds, then three rounds of an untimed and two
    # timed calls.
    assert events == ["call"] * 3 + ["begin"] + ["call"] * 9

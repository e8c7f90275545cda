"""Whether a latency measurement was taken on a busy machine, and what then to do.

The harness (timing.py) keeps this process's own threads from disturbing each other; it cannot
keep other processes off the cores. A report timed while something else ran showed `amp` at
batch 1 with p50 80.89 ms and p90 1,232.92 ms, and `torch-static` at 348.62 ms (1.95 ms on a
quiet run of a similar model), and said nothing about it. Two signals tell such a session:

- the CPU time other processes used, during the session's rounds, on the CPUs this process may
  run on: the busy time /proc/stat counts on them (user, nice, system, irq, softirq) less this
  process's own CPU time, over the wall time, is the cores others used on average. The session runs
  ``threads`` threads; others may use the remaining CPUs without taking any from it, so the
  session is busy when others used more than those spare CPUs plus OTHERS_CORES_MARGIN;
- the spread of each variant's rounds (Timing.round_spread): the same call on the same input
  takes the same time unless something took the machine during some of the rounds, which
  /proc/stat does not show where the neighbours are other guests or containers it does not
  count.

A session that is busy, or has a variant whose rounds spread beyond ROUND_SPREAD_LIMIT, is
timed again once others leave the cores free (or QUIET_MAX_WAIT has passed), at most RETRIES
times, and the quietest try is kept; one still busy or unstable is marked as such. Steal time
(the hypervisor running other guests on these CPUs) and the 1-minute load average are recorded
and not judged: the load average counts this process's own threads and follows a session of a
few seconds only a minute later, and steal has not been measured here to track contention (a
quiet 2-core Firecracker guest showed about 2% of its CPU time stolen).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from stages.measure.machine import allowed_cpus

if TYPE_CHECKING:
    from stages.measure.timing import Timing

# Cores other processes may use beyond the spare CPUs before a session counts as busy. A share
# this small of one core costs a 2-thread session about an eighth of its time, within the
# round-to-round noise the speed-up intervals already hold; one busy core is four times it.
OTHERS_CORES_MARGIN = 0.25
# Upper over lower quartile of a variant's round medians. On the quiet 2-core AMD EPYC here, 42
# timings of a variant (5 or 8 rounds, calls of 4 us to 2 ms) stayed within 1.6, and a shared AMD
# EPYC's coefficient of variation of 13-21% gives about 1.3. Beside a busy core a 2 ms call of two
# threads spread up to 2.41, but mostly far less: spread catches a burst that took part of the
# rounds; the cores others used catch a steady one.
ROUND_SPREAD_LIMIT = 2.0
RETRIES = 1  # a busy session is timed at most this many more times
# /proc/stat counts in clock ticks (100 a second): a window this long holds 50 on each CPU, so
# that the cores others used are read to within a few hundredths.
MIN_WINDOW = 0.5
QUIET_WINDOW = 0.5  # seconds of each look at whether others have left the cores free
QUIET_MAX_WAIT = 5.0  # seconds at most waited for that before timing again

BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (guest time is in user)
STEAL_FIELD = 7


def proc_stat_seconds(cpus: Iterable[int], path: str = "/proc/stat"
                      ) -> tuple[float, float] | None:
    """Busy and stolen CPU seconds since boot, summed over ``cpus``; None where there is no
    /proc/stat to read (not Linux)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    wanted = {f"cpu{cpu}" for cpu in cpus}
    busy = steal = found = 0
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if name in wanted:
            ticks = [int(f) for f in fields]
            busy += sum(ticks[i] for i in BUSY_FIELDS)
            steal += ticks[STEAL_FIELD] if len(ticks) > STEAL_FIELD else 0
            found += 1
    if found < len(wanted):  # CPUs numbered otherwise than the affinity mask (lxcfs): a part
        return None  # of them would undercount the load, so it is unknown, not idle
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, steal / tick


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@dataclass
class Reading:
    wall: float
    own: float  # CPU seconds of this process, all its threads
    system: tuple[float, float] | None  # busy and stolen CPU seconds of the watched CPUs
    load: float | None


class Meter:
    """Reads the cores others use while a session runs; every reader can be replaced."""

    def __init__(self, cpus: Iterable[int] | None = None,
                 stat: Callable[[Iterable[int]], tuple[float, float] | None] = proc_stat_seconds,
                 own: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep,
                 load: Callable[[], float | None] = load_average) -> None:
        self.cpus = list(cpus) if cpus is not None else allowed_cpus()
        self.stat, self.own, self.clock, self.sleep, self.load = stat, own, clock, sleep, load

    def read(self) -> Reading:
        return Reading(self.clock(), self.own(), self.stat(self.cpus), self.load())

    def usage(self, before: Reading, after: Reading) -> dict:
        """What the CPUs did between two readings, in cores on average."""
        wall = max(after.wall - before.wall, 1e-9)
        found = {"seconds": after.wall - before.wall, "others_cores": None,
                 "steal_cores": None, "load_average_1m": [before.load, after.load]}
        if before.system is not None and after.system is not None:
            busy = after.system[0] - before.system[0]
            own = after.own - before.own
            # Tick counts and this process's exact CPU time differ by a tick or two: a quiet
            # machine can come out a hair below zero.
            found["others_cores"] = max(0.0, busy - own) / wall
            found["steal_cores"] = (after.system[1] - before.system[1]) / wall
        return found

    def watch(self, session: Callable[..., dict]) -> tuple[dict, dict]:
        """Run ``session(begin=...)`` and say what others did from its call of ``begin`` (its
        rounds, after the warm-up: a first call that compiles keeps torch.compile's worker
        processes busy, and they are this report's work) to its end. A window shorter than
        MIN_WINDOW is stretched to it, slept, so that the ticks can tell a busy core."""
        start = [self.read()]

        def begin() -> None:
            start[0] = self.read()

        result = session(begin=begin)
        short = MIN_WINDOW - (self.clock() - start[0].wall)
        if short > 0:
            self.sleep(short)
        return result, self.usage(start[0], self.read())

    def wait_until_quiet(self, allowed_others: float, max_wait: float | None = None) -> float:
        """Look in QUIET_WINDOW windows until others use at most ``allowed_others`` cores, or
        ``max_wait`` (QUIET_MAX_WAIT) has passed; returns the seconds waited."""
        max_wait = QUIET_MAX_WAIT if max_wait is None else max_wait
        started = self.clock()
        while self.clock() - started < max_wait:
            before = self.read()
            self.sleep(QUIET_WINDOW)
            others = self.usage(before, self.read())["others_cores"]
            if others is None or others <= allowed_others:
                break
        return self.clock() - started


def judge(timings: dict[str, Timing], usage: dict, allowed_others: float) -> dict:
    """A session's conditions: busy (others over ``allowed_others``), the variants whose rounds
    spread beyond ROUND_SPREAD_LIMIT, and whether it is clean of both."""
    from stages.measure.timing import IDLE_MAX_WAIT

    spreads = {name: t.round_spread() for name, t in timings.items()}
    unstable = {name: spread for name, spread in spreads.items() if spread > ROUND_SPREAD_LIMIT}
    # Timed though this process's other threads still ran (a pool spinning on after a call):
    # the wait before a call gave up rather than found the process idle.
    never_idle = sorted(name for name, t in timings.items()
                        if t.idle_waits and max(t.idle_waits) >= IDLE_MAX_WAIT)
    others = usage["others_cores"]
    # Without the load of others (no /proc/stat line for these CPUs) busy is unknown, not no:
    # a session otherwise undisturbed is then neither clean nor not clean, but None.
    busy = None if others is None else others > allowed_others
    disturbed = bool(busy) or bool(unstable) or bool(never_idle)
    return usage | {"busy": busy, "unstable": unstable, "never_idle": never_idle,
                    "clean": False if disturbed else None if busy is None else True}


def all_clean(values: Iterable[bool | None]) -> bool | None:
    """Three-valued "and" of sessions' ``clean``: False where any was disturbed, else None
    where any is unknown, else True."""
    values = list(values)
    return False if False in values else None if None in values else True


def _disturbance(conditions: dict) -> tuple:
    return (bool(conditions["busy"]), len(conditions["unstable"])
            + len(conditions["never_idle"]), conditions["others_cores"] or 0.0)


class Watch:
    """Every timing session of one report, each timed again while the machine is busy, and
    what each was timed beside (report.json's ``timing_conditions``)."""

    def __init__(self, threads: int, meter: Meter | None = None, retries: int = RETRIES) -> None:
        self.meter = meter or Meter()
        self.threads, self.retries = threads, retries
        self.spare = max(0, len(self.meter.cpus) - threads)
        self.allowed_others = self.spare + OTHERS_CORES_MARGIN
        self.sessions: list[dict] = []

    def time(self, device: str, batch_size: int, session: Callable[..., dict[str, Timing]]
             ) -> dict[str, Timing]:
        """The timings of the quietest of at most 1 + retries runs of ``session``, which takes
        ``begin`` (timing.interleaved's) and calls it as its rounds start."""
        tries, waited = [], 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                waited += self.meter.wait_until_quiet(self.allowed_others)
            timings, usage = self.meter.watch(session)
            tries.append((timings, judge(timings, usage, self.allowed_others)))
            found = tries[-1][1]
            if not (found["busy"] or found["unstable"]):  # this process's own threads
                break  # (never_idle) are not what a quieter machine would change
        timings, kept = min(tries, key=lambda t: _disturbance(t[1]))
        self.sessions.append({"device": device, "batch_size": batch_size} | kept | {
            "tries": len(tries), "others_cores_per_try": [c["others_cores"] for _, c in tries],
            "waited_seconds": waited})
        return timings

    def record(self) -> dict:
        return {"clean": all_clean(s["clean"] for s in self.sessions), "cpus": len(self.meter.cpus),
                "threads": self.threads, "spare_cpus": self.spare,
                "others_cores_limit": self.allowed_others,
                "round_spread_limit": ROUND_SPREAD_LIMIT, "retries": self.retries,
                "sessions": self.sessions}


def sessions_of(record: dict, device: str) -> dict[str, dict]:
    return {str(s["batch_size"]): s for s in record["sessions"] if s["device"] == device}


def mark_verdict(verdict: dict, record: dict, device: str) -> dict:
    """``timing_clean`` on a device's verdict and on each of its batch sizes."""
    sessions = sessions_of(record, device)
    for size, choice in verdict["per_batch_size"].items():
        choice["timing_clean"] = sessions[size]["clean"]
    verdict["timing_clean"] = all_clean(c["timing_clean"]
                                        for c in verdict["per_batch_size"].values())
    return verdict


def describe(session: dict, record: dict) -> str:
    """What disturbed a session that is not clean, in one sentence for report.md and the
    warnings."""
    where = f"at batch {session['batch_size']} on the {session['device'].upper()}"
    tries = (f" in each of {session['tries']} tries" if session["tries"] > 1 else "")
    parts = []
    if session["busy"]:
        parts.append(
            f"other processes used {session['others_cores']:.2f} cores on average while the "
            f"variants were timed {where}{tries} (this report's {record['threads']} threads on "
            f"{record['cpus']} CPUs leave {record['spare_cpus']} spare; more than "
            f"{record['others_cores_limit']:.2f} is a busy machine)")
    if session["unstable"]:
        spread = ", ".join(f"`{name}` {value:.2f}x" for name, value in
                           sorted(session["unstable"].items(), key=lambda item: -item[1]))
        parts.append(
            f"the rounds of {spread} {where} varied more than {record['round_spread_limit']:g}x "
            "between their slower and faster quarters, so something took the machine during "
            "some of them")
    if session.get("never_idle"):
        parts.append(
            f"{', '.join(f'`{name}`' for name in session['never_idle'])} {where} was timed "
            "while other threads of this process still used the CPU (the wait for them gave "
            "up)")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def warnings(record: dict | None) -> list[str]:
    if not record:
        return []
    return [describe(s, record) + " These latencies and speed-ups are not clean figures" + (
        ": run 'pipeline report' again on a quiet machine." if s["busy"] or s["unstable"] else
        ": they may include that work.")
            for s in record["sessions"] if s["clean"] is False]


def caveat(record: dict | None) -> list[str]:
    """report.md's word on what disturbed the timing, where something did: figures taken
    beside other work are never presented as clean."""
    if not record or record["clean"]:
        return []
    if record["clean"] is None:
        return ["**Whether the machine was quiet while timing is unknown:** the load of other "
                "processes could not be read (no /proc/stat line for these CPUs). The rounds "
                "were steady, but a steady load beside them would go unnoticed.", ""]
    disturbed = [s for s in record["sessions"] if s["clean"] is False]
    busy, unsteady = (any(s[key] for s in disturbed) for key in ("busy", "unstable"))
    title = ("Timed on a busy machine" if busy else "Timed in unsteady rounds" if unsteady
             else "Timed beside this process's own busy threads")  # a quieter machine won't do
    again = (" Measure them again on a quiet machine (`pipeline report` on this run) before "
             "trusting the speed-ups and the choice made on them." if busy or unsteady else "")
    return [f"**{title}: these latencies are not clean figures.** "
            + " ".join(describe(s, record) for s in disturbed) + again, ""]


def quiet_sentence(record: dict | None) -> str:
    """How busy the machine was while timing, for the table's note."""
    sessions = (record or {}).get("sessions", [])
    measured = [s["others_cores"] for s in sessions if s["others_cores"] is not None]
    if not measured:
        return (" The load of other processes could not be read (no /proc/stat line for these "
                "CPUs), so a busy machine would go unnoticed.") if sessions else ""
    state = {True: "clean", False: "not clean, as the verdict says",
             None: "unknown where the load could not be read"}[record["clean"]]
    return (f" Other processes used at most {max(measured):.2f} cores on average while a batch "
            f"size was timed (from /proc/stat; over {record['others_cores_limit']:.2f} a "
            f"batch size is timed again, at most {record['retries']} more time(s)): {state}.")

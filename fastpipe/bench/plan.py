"""How long each of `fastpipe bench`'s measurements runs, so that the whole command answers within --max-seconds.

One step of each part is timed first (the probe: a model step, a loader's start and a few of its batches). From
those, every measurement to come has a floor: the steps and seconds its figure needs to carry a verdict
(verdict.py), each step counted at SLACK times the probe's. When the floors do not fit in the budget, nothing is
measured: the bench says which budget would do (`Schedule.refusal`). Otherwise each measurement, as it starts, gets
its floor and a share of what is left beyond the others' floors, in proportion to what --steps/--windows/--warmup
ask; a measurement never takes more than they ask when the budget holds it all. Plans are made again before each
measurement from the time actually left and the step times measured so far, so a slow measurement shortens the
later ones instead of overrunning the total.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from fastpipe.bench.timing import Budget
from fastpipe.bench.verdict import LOADER_SECONDS, MIN_SECONDS, MIN_STEPS

SLACK = 1.25  # a floor counts each step at 1.25x the probe's: steps vary, and a busier machine slows them
TAIL, TAIL_SHARE = 3.0, 0.05  # kept for the report, the plot and the process's end: 3 s, at most 5 % of the budget
PROBE_SECONDS, PROBE_STEPS = 1.0, 5  # a probe takes steps until 1 s has passed, at most 5
PROBE_SHARE = 0.02  # ... or this share of the budget: the steps after the first shed its start-up costs


@dataclass(frozen=True)
class Part:
    """One measurement to come. `uses`: the probed times one of its steps takes (a model step, a loader's batch, or
    both for end to end); `start`: the probed time paid before its first step (a loader's start)."""

    key: str
    uses: tuple[str, ...]
    start: str | None = None
    loader: bool = False  # a loader alone: timed by images over at least LOADER_SECONDS, not by a count of steps


@dataclass(frozen=True)
class Allot:
    """What one measurement gets: measure()'s arguments; `deadline` (a perf_counter time) is when it should end,
    `hard` when the whole budget does (less the tail): no step goes past that, not even for a figure's floor."""

    deadline: float | None
    hard: float | None
    warmup: int
    windows: int
    window_steps: int
    window_seconds: float
    min_seconds: float

    def measure_args(self, batch_size: int) -> dict:
        now = time.perf_counter()
        return {"warmup": self.warmup, "windows": self.windows, "window_images": self.window_steps * batch_size,
                "window_seconds": self.window_seconds, "min_steps": MIN_STEPS, "min_seconds": self.min_seconds,
                "max_seconds": None if self.deadline is None else max(self.deadline - now, 0.0),
                "hard_seconds": None if self.hard is None else max(self.hard - now, 0.0)}


def probe(step, seconds: float = PROBE_SECONDS) -> float:
    """Seconds one step takes, warm: steps until `seconds` have passed (at least one, at most PROBE_STEPS), and the
    fastest after the first, which pays for what runs once (allocations, kernels chosen, pages touched). A first
    step slower than `seconds` is taken alone: it is its own warm-up, and counts as it was (a high estimate)."""
    start, times = time.perf_counter(), []
    for _ in range(PROBE_STEPS):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start >= seconds:
            break
    return min(times[1:] or times)


class Schedule:
    """The measurements still to come, the probed or measured time of each of their steps, and the budget."""

    def __init__(self, budget: Budget, steps: int, windows: int, warmup: int):
        self.budget, self.ask = budget, (steps, windows, warmup)
        self.est: dict[str, float] = {}
        self.parts: dict[str, Part] = {}

    def estimate(self, key: str, seconds: float) -> None:
        self.est[key] = max(seconds, 1e-6)

    def add(self, *parts: Part) -> None:
        self.parts.update({p.key: p for p in parts})

    def step(self, p: Part) -> float:
        return sum(self.est[k] for k in p.uses)

    def _start(self, p: Part) -> float:
        return self.est[p.start] if p.start else 0.0

    def floor(self, p: Part) -> float:
        """Seconds the figure needs at the least: its start, and MIN_STEPS steps (a loader: LOADER_SECONDS too)."""
        return self._start(p) + SLACK * max(MIN_STEPS * self.step(p), _least(p))

    def wanted(self, p: Part) -> float:
        steps, windows, warmup = self.ask
        return max(self.floor(p), self._start(p) + (warmup + windows * steps) * self.step(p))

    def tail(self) -> float:
        return min(TAIL, TAIL_SHARE * (self.budget.total or 0.0))

    def probe_seconds(self) -> float:
        return max(PROBE_SECONDS, PROBE_SHARE * (self.budget.total or 0.0))

    def need(self, *extra: Part) -> float:
        """Seconds from the budget's start to the end of the command when every part to come gets its floor."""
        return self.budget.elapsed() + sum(self.floor(p) for p in (*self.parts.values(), *extra)) + self.tail()

    def fits(self, *extra: Part) -> bool:
        return self.budget.total is None or self.need(*extra) <= self.budget.total

    def take(self, key: str) -> Allot:
        """The plan of the part `key`, which starts now: its floor and its share of the time beyond the floors."""
        p = self.parts[key]
        steps, windows, warmup = self.ask
        if self.budget.total is None:
            del self.parts[key]
            return Allot(None, None, warmup, windows, steps, 0.0, _least(p))
        left = self.budget.left() - self.tail()
        floors = sum(self.floor(q) for q in self.parts.values())
        wants = sum(self.wanted(q) for q in self.parts.values())
        del self.parts[key]
        now = time.perf_counter()
        hard = now + left
        if left >= wants:  # the budget holds what was asked: that, with the spare time as a margin
            return Allot(now + self.wanted(p) * left / wants, hard, warmup, windows, steps, 0.0, _least(p))
        if left >= floors:
            seconds = self.floor(p) + (left - floors) * (self.wanted(p) - self.floor(p)) / max(wants - floors, 1e-9)
        else:  # slower than probed: the figures to come may fall short, and say so
            seconds = max(left, 0.0) * self.floor(p) / max(floors, 1e-9)
        return self._fitted(p, now + seconds, hard, seconds - self._start(p))

    def _fitted(self, p: Part, deadline: float, hard: float, seconds: float) -> Allot:
        """Fewer, longer windows when few steps fit; each window then runs for its share of the time."""
        _, windows, warmup = self.ask
        n = max(MIN_STEPS, int(seconds / self.step(p)))
        warmup = min(warmup, max(0, n - math.ceil(MIN_STEPS * SLACK)) // 2)
        timed = n - warmup
        windows = min(windows, max(1, timed // MIN_STEPS))
        body = max(seconds - warmup * self.step(p), 0.0)
        return Allot(deadline, hard, warmup, windows, math.ceil(MIN_STEPS / windows), body / windows, _least(p))

    def batch_that_fits(self, batch: int) -> int | None:
        """The largest power-of-two batch below `batch` whose floors fit the budget, assuming a step's time grows
        with the batch (starts, the loader's LOADER_SECONDS and the time spent so far do not); None: none does."""
        parts = list(self.parts.values())
        scaled = sum(SLACK * MIN_STEPS * self.step(p) for p in parts if MIN_STEPS * self.step(p) > _least(p))
        fixed = self.need() - scaled
        if not scaled or self.budget.total is None or self.budget.total <= fixed:
            return None
        b = 2 ** int(math.log2(max(batch * (self.budget.total - fixed) / scaled, 1)))
        return b if 2 <= b < batch else None

    def suggested_seconds(self) -> int:
        """--max-seconds that would hold the floors, rounded up with a margin (a new run probes again)."""
        return int(math.ceil(self.need() * 1.1 / 10) * 10)


def _least(p: Part) -> float:
    """Seconds a figure must have timed, whatever its steps."""
    return LOADER_SECONDS if p.loader else MIN_SECONDS

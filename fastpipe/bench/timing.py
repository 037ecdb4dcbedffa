"""Honest throughput: warm up, synchronise the device before reading the clock, median of windows, and a time
budget that is kept (warm-up included; how many steps and windows each measurement gets is plan.py's)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

from fastpipe.loaders.stats import OthersClock
from fastpipe.util import Ticker


@dataclass
class Throughput:
    img_per_s: float  # median over the windows
    low: float  # slowest window
    high: float  # fastest window
    images: int
    seconds: float  # the whole measurement, warm-up included
    windows: list[float] = field(default_factory=list)
    steps: int = 0  # timed steps, over all windows
    timed_seconds: float = 0.0  # the windows' own time (warm-up excluded)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.img_per_s:,.0f} img/s ({self.low:,.0f}-{self.high:,.0f})"


class Budget:
    """Seconds for a whole run, counted from `started` (a perf_counter time: the command's own start, so that the
    interpreter's start, the imports and the model's construction count too; default: now). None: no limit."""

    def __init__(self, seconds: float | None, started: float | None = None):
        self.total = seconds
        self.start = time.perf_counter() if started is None else started

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float | None:
        return None if self.total is None else self.total - self.elapsed()

    def describe(self) -> str:
        return "no time limit" if self.total is None else f"within {self.total:.0f} s (--max-seconds)"


def process_start() -> float:
    """When this process started, as a perf_counter time: what a command's budget counts from (the interpreter's
    start and the imports count too)."""
    try:  # Linux: the start in clock ticks since boot, to the hundredth of a second
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        age = time.time() - psutil.Process().create_time()
    return time.perf_counter() - max(age, 0.0)


def spread(values: list[float]) -> dict:
    """Repeated runs of one variant: their median and range (benchmarks report both, never a best run)."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "n": len(values)}


def run_fresh(args: list[str], what: str) -> dict:
    """`python ARGS` in a new process, which prints its result as the last JSON line; a failure stops the
    benchmark with the child's error. For runs that must not inherit this process's state (glibc's allocator
    adapts to what a process allocated and freed, and forked workers inherit that)."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def endless(make_epoch: Callable[[int], Iterable]) -> Iterator:
    """Batches across epoch boundaries: make_epoch(e) returns epoch e's iterable."""
    epoch = 0
    while True:
        n = 0
        for batch in make_epoch(epoch):
            n += 1
            yield batch
        if n == 0:
            raise RuntimeError("an epoch yielded no batches")
        epoch += 1


def cuda_sync(device) -> Callable[[], None]:
    import torch

    if str(device).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure(step: Callable[[], int], *, warmup: int = 2, windows: int = 3, window_images: int = 512,
            window_seconds: float = 0.0, min_steps: int = 1, min_seconds: float = 0.0,
            sync: Callable[[], None] = lambda: None, max_seconds: float | None = None,
            hard_seconds: float | None = None) -> Throughput:
    """Call `step()` (returns the images it processed) up to `warmup` times, then time `windows` windows; a window
    ends once it has `window_images` images and has run `window_seconds` (what was asked). With `max_seconds`, the
    whole call (warm-up included) keeps within it: warm-up stops after a quarter of it, and once a window has its
    part of the floor (`min_steps`, `min_seconds`), no step starts that the last one says would end after the
    window's share of what is left. `hard_seconds` is a limit for the floor too: no step starts that would end after
    it (but each window timed takes one), and no window after it; the figure then falls short, and says so."""
    start = time.perf_counter()
    limit = max_seconds if max_seconds is not None else math.inf
    hard = hard_seconds if hard_seconds is not None else math.inf
    step_s = 0.0

    def late() -> bool:  # the next step, as long as the last, would end after the hard limit
        return time.perf_counter() - start + step_s > hard

    for _ in range(warmup):
        if late():
            break
        t = time.perf_counter()
        step()
        sync()
        step_s = time.perf_counter() - t
        if time.perf_counter() - start > limit / 4:
            break
    least, least_s = max(1, math.ceil(min_steps / windows)), min_seconds / windows
    rates, total_n, steps, timed = [], 0, 0, 0.0
    for w in range(windows):
        if rates and late():
            break
        share = (limit - (time.perf_counter() - start)) / (windows - w)
        sync()
        w_start, n, k = time.perf_counter(), 0, 0
        while True:
            spent = time.perf_counter() - w_start
            if k and late():
                break
            if k >= least and spent >= least_s and (
                    (n >= window_images and spent >= window_seconds) or spent + step_s > share):
                break  # the window has what it asked for, or the next step would end after its share
            t = time.perf_counter()
            n += step()
            k += 1
            step_s = time.perf_counter() - t
        sync()  # the clock is read only after the device has finished the window's work
        rates.append(n / (time.perf_counter() - w_start))
        timed += time.perf_counter() - w_start
        total_n, steps = total_n + n, steps + k
    return Throughput(statistics.median(rates), min(rates), max(rates), total_n, time.perf_counter() - start, rates,
                      steps, timed)


class Utilisation(Ticker):
    """CPU % (psutil) and GPU % (NVML through torch, where installed) sampled in the background, and the CPU time
    other processes took meanwhile (the machine's busy time less this process's and its children's): what tells
    a measurement disturbed by other work from one of this setup."""

    def __init__(self, device: str):
        import psutil

        super().__init__(0.2, self._sample, "fastpipe-utilisation")
        self.device, self.cpu, self.gpu = device, [], []
        psutil.cpu_percent(None)  # the first call only starts psutil's interval

    def __enter__(self):
        self._others = OthersClock()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.others = self._others.share()

    def _sample(self) -> None:
        import psutil
        import torch

        self.cpu.append(psutil.cpu_percent(None))
        if self.device.startswith("cuda"):
            with contextlib.suppress(Exception):  # without NVML (pynvml) the GPU figure is simply absent
                self.gpu.append(torch.cuda.utilization(torch.device(self.device)))

    def summary(self) -> dict:
        avg = lambda xs: round(sum(xs) / len(xs), 1) if xs else None  # noqa: E731
        return {"cpu_pct": avg(self.cpu), "gpu_pct": avg(self.gpu),
                "others_cpu_pct": round(100 * getattr(self, "others", 0.0), 1)}

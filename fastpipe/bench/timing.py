"""Honest throughput: warm up, synchronise the device before reading the clock, median of windows."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field


@dataclass
class Throughput:
    img_per_s: float  # median over the windows
    low: float  # slowest window
    high: float  # fastest window
    images: int
    seconds: float
    windows: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.img_per_s:,.0f} img/s ({self.low:,.0f}-{self.high:,.0f})"


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
            sync: Callable[[], None] = lambda: None, max_seconds: float | None = None) -> Throughput:
    """Call `step()` (returns the images it processed) `warmup` times, then time `windows` windows of at least
    `window_images` images each (or max_seconds / windows seconds, whichever comes first)."""
    for _ in range(warmup):
        step()
    rates, total_n, total_t = [], 0, 0.0
    limit = max_seconds / windows if max_seconds else float("inf")
    for _ in range(windows):
        sync()
        start, n = time.perf_counter(), 0
        while n < window_images and time.perf_counter() - start < limit:
            n += step()
        sync()  # the clock is read only after the device has finished the window's work
        dt = time.perf_counter() - start
        rates.append(n / dt)
        total_n, total_t = total_n + n, total_t + dt
    return Throughput(statistics.median(rates), min(rates), max(rates), total_n, total_t, rates)

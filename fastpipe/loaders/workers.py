"""How many loader worker processes to use on this machine."""

from __future__ import annotations

import os


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def heuristic_workers(devices: int = 1) -> int:
    """The starting point before any measurement: the cores per device, less one for the training process
    when there are enough to spare, at most 16 (more rarely helps and costs memory per worker)."""
    per_device = usable_cores() // max(devices, 1)
    return max(1, min(per_device - 1 if per_device > 3 else per_device, 16))

"""Memory that keeps growing step after step, told apart from the allocator's caching and the first steps' growth.

Sampled at every step boundary after warm-up (CUDA: torch.cuda.memory_allocated, what tensors hold; a CPU: what the
process's live allocations hold, process_memory). A leak of the
usual kind (each step's loss kept with its graph, outputs appended to a list) rises by about the same amount every
step; the allocator's caching and a pool filling up rise in a step or a few and stay. So a rise is flagged only when
the window's eight parts each sit higher than the one before, by at least a quarter of an even share of the whole
rise, and the whole rise is at least MIN_RISE: a jump, or a staircase of a few, moves a few part boundaries only.
A slow leak (a few kB a step) rises less than MIN_RISE in WINDOW steps: the same test runs on every 16th boundary
too, a window sixteen times as long.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import statistics

WINDOW = 1024  # steps: the boundaries looked at (the latest)
MIN_STEPS = 100  # steps after warm-up before a trend can be told
CHECK_EVERY = 25  # samples between looks
PARTS = 8  # the window's parts, each of which must sit higher than the one before
MIN_RISE = 16 << 20  # bytes over the window: below that, noise or nothing that matters
CAUSES = ("something keeps each step alive: a list of losses or outputs that still hold their graphs (keep "
          "loss.item() or loss.detach()), metrics accumulated on the device, or a cache keyed by step")


def process_memory() -> int:
    """Bytes this process's live allocations hold: glibc's count of what malloc has handed out and not taken back
    (mallinfo2: freed memory the allocator keeps for reuse is not counted, so a leak shows from its first step even
    where earlier work left a pool to reuse); elsewhere, the anonymous resident memory (shard pages that a memory
    map brings in are file-backed, not counted)."""
    held = _malloc_held()
    if held:
        return held
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().memory_info().rss


class _MallInfo2(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                           "fsmblks", "uordblks", "fordblks", "keepcost"))


def _mallinfo2():
    try:
        f = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later (0.4 us a call)
    except (AttributeError, OSError):
        return None
    f.restype = _MallInfo2
    return f


_MALLINFO2 = _mallinfo2()


def _malloc_held() -> int:
    """0 where unknown (no glibc, or another allocator preloaded, whose use glibc does not see)."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


class Growth:
    """Feed `add(step, bytes)` at every step boundary after warm-up; `found` is set once, when a sustained rise is
    seen: {"since_step", "bytes_per_step", "full_at_step", "text"}."""

    def __init__(self, capacity: int | None, where: str):
        self.capacity, self.where = capacity, where
        self.samples: collections.deque[tuple[int, int]] = collections.deque(maxlen=WINDOW)
        self.coarse: collections.deque[tuple[int, int]] = collections.deque(maxlen=WINDOW)  # every 16th
        self.found: dict | None = None
        self.peak, self._added = 0, 0

    def add(self, step: int, used: int) -> dict | None:
        """The finding, the first time there is one (None otherwise)."""
        self.samples.append((step, used))
        self._added += 1
        if self._added % 16 == 0:
            self.coarse.append((step, used))
        self.peak = max(self.peak, used)
        if self.found is None and self._added % CHECK_EVERY == 0:
            self.found = self._trend(self.samples) or (self._trend(self.coarse) if self._added % 400 == 0 else None)
            return self.found
        return None

    def _trend(self, samples) -> dict | None:
        rows = list(samples)
        if len(rows) < MIN_STEPS:
            return None
        n = len(rows) // PARTS
        parts = [rows[i * n : (i + 1) * n] for i in range(PARTS)]
        levels = [statistics.median(m for _, m in part) for part in parts]
        rise = levels[-1] - levels[0]
        if rise < MIN_RISE or any(b - a < rise / (4 * (PARTS - 1)) for a, b in itertools.pairwise(levels)):
            return None
        centres = [statistics.fmean(s for s, _ in part) for part in parts]
        rate = rise / (centres[-1] - centres[0])
        since, now = rows[0][0], rows[-1]
        full = now[0] + int((self.capacity - now[1]) / rate) if self.capacity else None
        text = (f"memory grows {rate / 2**20:.2f} MB a step since step {since:,} ({self.where}: "
                f"{now[1] / 2**20:,.0f} MB at step {now[0]:,}"
                + (f"; full near step {full:,}" if full is not None else "") + f"): {CAUSES}")
        return {"since_step": since, "bytes_per_step": rate, "full_at_step": full, "text": text}


# -- where it grows, on CUDA (watch(..., trace_memory=True)) ------------------------------------------------------
def start_tracing(device) -> dict[str, int]:
    """Record the Python stack of every live CUDA allocation from now on (PyTorch's memory history, state only: no
    event log), and return the bytes each allocation site holds now."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="state", context="alloc", stacks="python", device=device)
    return site_bytes(device)


def stop_tracing(device) -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None, device=device)


def site_bytes(device) -> dict[str, int]:
    """Bytes of live allocations per site: the innermost frame of the caller's code (not torch's, not fastpipe's)."""
    import torch

    sites: dict[str, int] = {}
    for segment in torch.cuda.memory._snapshot(device)["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                where = _site(block.get("frames") or [])
                sites[where] = sites.get(where, 0) + block["size"]
    return sites


def _site(frames: list[dict]) -> str:
    for f in frames:  # innermost first
        name = str(f.get("filename", ""))
        if not name.startswith("<") and "/torch/" not in name and "/fastpipe/" not in name:
            return f"{name}:{f.get('line')} in {f.get('name')}"
    return "allocated before tracing began, or inside torch with no frame of yours"


def growing_sites(before: dict[str, int], after: dict[str, int], top: int = 3) -> list[tuple[str, int]]:
    """The sites whose live bytes grew most between two snapshots, largest first."""
    grown = sorted(((k, v - before.get(k, 0)) for k, v in after.items()), key=lambda kv: -kv[1])
    return [(k, d) for k, d in grown[:top] if d > 0]

"""How many loader worker processes to use on this machine."""

from __future__ import annotations

import math
import os

from fastpipe.util import usable_cores


def heuristic_workers(devices: int = 1) -> int:
    """The starting point before any measurement: the cores per device, less one for the training process
    when there are enough to spare, at most 16 (more rarely helps and costs memory per worker)."""
    per_device = usable_cores() // max(devices, 1)
    return max(1, min(per_device - 1 if per_device > 3 else per_device, 16))


def _cache_path():
    from pathlib import Path

    base = os.environ.get("FASTPIPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fastpipe")
    return Path(base) / "workers.json"


def _candidates() -> list[int]:
    cores = usable_cores()
    return sorted({c for c in (1, 2, 4, 6, 8, 12, 16, cores) if c <= cores})


def _probe(manifest, cfg, backend: str, workers: int, seconds: float) -> float:
    """Images/s of the loader alone with `workers` processes, after one warm-up batch."""
    import time
    from dataclasses import replace

    from fastpipe.loaders import make_loader_from

    loader = make_loader_from(manifest, replace(cfg, num_workers=workers, split="train", device="cpu",
                                                pin_memory=False), backend)
    it = iter(loader)
    next(it)
    n, start = 0, time.perf_counter()
    for x, _ in it:
        n += len(x)
        if time.perf_counter() - start > seconds:
            break
    return n / max(time.perf_counter() - start, 1e-9)


def tuned_workers(manifest, cfg, backend: str, seconds: float = 2.0) -> int:
    """Measured once per machine, data set and batch shape, then read from the cache: the smallest worker
    count within 5 % of the fastest, so that spare cores stay with the training process."""
    import json
    import logging
    import platform

    where = manifest.location if manifest.remote else manifest.root.resolve()
    key = "|".join(map(str, (platform.node(), usable_cores(), where,
                             manifest.settings.get("fingerprint", ""), backend, cfg.image_size, cfg.batch_size)))
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    log = logging.getLogger("fastpipe")
    if key in cache:
        log.info("num_workers=%d (measured earlier, cached in %s)", cache[key]["workers"], path)
        return cache[key]["workers"]
    rates = {w: _probe(manifest, cfg, backend, w, seconds) for w in _candidates()}
    best = max(rates.values())
    chosen = min(w for w, r in rates.items() if r >= 0.95 * best)
    cache[key] = {"workers": chosen, "img_per_s": {str(k): round(v, 1) for k, v in rates.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))
    log.warning("num_workers=%d chosen by a probe (%s img/s); cached in %s", chosen,
                ", ".join(f"{w}: {r:.0f}" for w, r in rates.items()), path)
    return chosen


SHM = "/dev/shm"
SHM_USABLE = 0.75  # leave room for other processes' and PyTorch's own shared memory


def shm_free(path: str = SHM) -> int | None:
    """Free bytes of the shared-memory filesystem worker batches travel through (None: no such mount)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fit_shared_memory(workers: int, batch_bytes: int, prefetch: int, free: int | None) -> tuple[int, int, str]:
    """(workers, prefetch factor, note) whose batches fit in shared memory, as close to the asked ones as possible.

    Each worker holds its queued batches plus the one it fills and the one the trainer holds: prefetch + 2 buffers
    of batch_bytes. Docker's default /dev/shm is 64 MB: batch 64 at 224 px (9.6 MB) with 2 workers and prefetch 4
    needs 115 MB and would fail inside a worker with "unable to allocate shared memory". So the prefetch factor
    goes down first, then the worker count; with no room for even one worker, decoding moves into the training
    process (no shared memory at all). The note says what was lowered and how to lift it ("" when nothing was)."""
    if not workers or free is None:
        return workers, prefetch, ""
    usable = free * SHM_USABLE
    for w in range(workers, 0, -1):
        for p in range(prefetch, 0, -1):
            if w * (p + 2) * batch_bytes <= usable:
                if (w, p) == (workers, prefetch):
                    return w, p, ""
                return w, p, _shm_note(free, workers, prefetch, batch_bytes, f"{w} workers, prefetch {p}")
    return 0, prefetch, _shm_note(free, workers, prefetch, batch_bytes, "decoding in the training process")


def _shm_note(free: int, workers: int, prefetch: int, batch_bytes: int, now: str) -> str:
    suggest = max(1, math.ceil(workers * (prefetch + 2) * batch_bytes / SHM_USABLE / 2**30))
    return (f"{SHM} has {free / 2**20:.0f} MB free, too little for {workers} workers x {prefetch + 2} batches of "
            f"{batch_bytes / 2**20:.1f} MB: running with {now}, which is slower. Give the container more shared "
            f"memory: docker run --shm-size={suggest}g (or --ipc=host)")

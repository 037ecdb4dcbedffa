"""How many loader workers to use on this machine, processes or threads, and what shared memory allows."""

from __future__ import annotations

import math
import os
import sys

from fastpipe.util import read_json, usable_cores

# Worker threads by default up to this many workers (where the decoder releases the GIL). Each image still holds
# the GIL for about 1 % of a worker thread's time with the crop decoder's C path, 7 % with the per-sample path
# (a batch's bookkeeping: benchmarks/profile_worker.py --gil), so N threads keep it busy about N x 1-7 % of the
# time, plus what the training step holds. Not yet measured on a many-core host; above this, processes, unless
# /dev/shm cannot hold their batches (processes would then be cut down to fit).
DEFAULT_THREADS_UP_TO = 8
# A training step whose thread runs this share of it or more (Python that never pauses: a launch-bound step) holds
# the GIL the loader's threads need: the default switches to worker processes after the first epoch. Measured with
# a stand-in step (benchmarks/bench_step.py, docs/results/step.json): where the step held the GIL 8 ms of 8, processes
# gave 1.06x the threads' steps/s; 3 of 3, about even (1.02x); where it released it for part of the step, threads
# were even or ahead (1.28x at 1 ms of 6).
STEP_PYTHON = 0.6
# ... at once where the loop waited for batches; where it did not, after one epoch in processes, if the loop ran this
# much faster in them (threads keep their memory and /dev/shm savings otherwise).
TRIAL_GAIN = 1.03


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


def gil_enabled() -> bool:
    """False on a free-threaded CPython (3.13t and later) running without the GIL: there every decoder runs in
    parallel in threads, Pillow's too."""
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def _probe(manifest, cfg, backend: str, workers: int, threads: bool, seconds: float) -> float:
    """Images/s of the loader alone with `workers` processes or threads, after one warm-up batch."""
    import time
    from dataclasses import replace

    from fastpipe.loaders import make_loader_from

    loader = make_loader_from(manifest, replace(cfg, num_workers=workers, threads=threads, split="train",
                                                device="cpu", pin_memory=False), backend)
    try:
        it = iter(loader)
        next(it)
        n, start = 0, time.perf_counter()
        for x, _ in it:
            n += len(x)
            if time.perf_counter() - start > seconds:
                break
        return n / max(time.perf_counter() - start, 1e-9)
    finally:
        loader.close()


def tuned_workers(manifest, cfg, backend: str, seconds: float = 2.0) -> tuple[int, bool]:
    """(workers, whether threads) measured once per machine, data set, batch shape and decoder, then read from
    the cache: the smallest worker count within 5 % of the fastest, so that spare cores stay with the training
    process, in the faster of the modes at that count. Both modes are measured unless `cfg.threads` names one."""
    import json
    import logging
    import platform

    where = manifest.files.identity if manifest.files is not None else manifest.root.resolve()
    modes = (False, True) if cfg.threads is None else (cfg.threads,)
    key = "|".join(map(str, (platform.node(), usable_cores(), where, manifest.settings.get("fingerprint", ""),
                             backend, cfg.image_size, cfg.batch_size, cfg.cpu_decoder, "threads", *modes)))
    path = _cache_path()
    try:
        cache = read_json(path)
    except (OSError, ValueError):
        cache = {}
    log = logging.getLogger("fastpipe")
    if key in cache:
        got = cache[key]
        log.info("num_workers=%d, %s (measured earlier, cached in %s)", got["workers"], _mode(got["threads"]), path)
        return got["workers"], got["threads"]
    rates = {(w, t): _probe(manifest, cfg, backend, w, t, seconds) for t in modes for w in _candidates()}
    best = max(rates.values())
    workers = min(w for (w, _), r in rates.items() if r >= 0.95 * best)
    threads = max((t for w, t in rates if w == workers), key=lambda t: rates[workers, t])
    cache[key] = {"workers": workers, "threads": threads,
                  "img_per_s": {f"{w} {_mode(t)}": round(r, 1) for (w, t), r in rates.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))
    log.warning("num_workers=%d, %s, chosen by a probe (img/s: %s); cached in %s", workers, _mode(threads),
                ", ".join(f"{w} {_mode(t)} {r:.0f}" for (w, t), r in rates.items()), path)
    return workers, threads


def _mode(threads: bool) -> str:
    return "threads" if threads else "processes"


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
    return (f"{SHM} has {free / 2**20:.0f} MB free, too little for {workers} worker processes x {prefetch + 2} "
            f"batches of {batch_bytes / 2**20:.1f} MB: running with {now}, which is slower. Give the container more "
            f"shared memory: docker run --shm-size={suggest}g (or --ipc=host), or make the workers threads "
            f"(threads=True, --threads on), which use none")

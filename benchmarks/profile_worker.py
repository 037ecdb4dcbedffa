"""Where a loader worker's time goes: the torch backend's whole per-batch path run in this process
(num_workers=0, so the profiler sees it), grouped into decode, resize + flip, crop draws, machinery (plan, shard
reading, labels) and batch assembly.

    python benchmarks/profile_worker.py --shards OUT [--epochs 6] [--json bench-results/worker-profile.json]
    python benchmarks/profile_worker.py --shards OUT --gil   # the share that holds the GIL: a worker thread's
                                                              # work, and the whole loop in one process
    python benchmarks/profile_worker.py --shards OUT --gil --rounds 5   # the C training path against the Python
                                                                         # one, interleaved, medians

cProfile adds a fixed cost per Python call, so the Python-heavy groups (machinery, draws) read high; the split is
what to optimise next, the loaders' speed comes from bench_loaders.py and bench_peers.py.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
from pathlib import Path

import torch

from fastpipe import make_loader

# (group, test on "file:function") — the first match wins; what matches none is assembly and the loop itself.
GROUPS = [
    # simplejpeg is compiled without profiling hooks: its decode is counted inside cpu_ops._fast / _header
    ("decode (crop decoder, simplejpeg in cpu_ops._fast, Pillow)",
     lambda f: f.endswith(("cpu_ops.py:_fast", "cpu_ops.py:_header")) or "_jpegcrop" in f or "ImagingDecoder" in f
     or "ImageFile.py" in f),
    ("resize + flip (OpenCV)", lambda f: f.endswith(("<resize>", "<flip>")) or "ImagingCore" in f),
    ("crop and flip draws", lambda f: "rng.py" in f or "random_resized_crop_box" in f or "draw_train_params" in f),
    ("machinery: plan, shard reading, labels", lambda f: any(m in f for m in ("shards.py", "epoch.py", "stream.py",
                                                                               "shardformat.py", "mmap"))),
]


def profile(shards: str, epochs: int) -> dict:
    torch.set_num_threads(1)
    loader = make_loader(shards, "torch", batch_size=64, image_size=224, num_workers=0, device="cpu",
                         normalize=False)

    def run():
        n = 0
        for e in range(epochs):
            loader.set_epoch(e)
            n += sum(len(x) for x, _ in loader)
        return n

    run()  # warm: memory maps, page cache
    prof = cProfile.Profile()
    images = prof.runcall(run)
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    groups = {g: 0.0 for g, _ in GROUPS}
    other = total = 0.0
    for (file, _line, func), (_cc, _nc, tottime, _cum, _callers) in stats.items():
        total += tottime
        key = f"{file}:{func}"
        for g, test in GROUPS:
            if test(key):
                groups[g] += tottime
                break
        else:
            other += tottime
    groups["batch assembly, loop, the rest"] = other
    return {"images": images, "us_per_image": {g: 1e6 * t / images for g, t in groups.items()},
            "share": {g: t / total for g, t in groups.items()}, "total_us_per_image": 1e6 * total / images}


def gil_held(shards: str, epochs: int, batch: int = 64, where: str = "worker thread") -> dict:
    """µs per image that hold the GIL: the wall time less the time the calls that release it ran without it: the
    crop decoder's (its header, decode and training chunks: their own clock, `released()`, so what they do holding
    the GIL, taking and giving back their arguments, counts as held) and simplejpeg's decode and OpenCV's resize and
    flip (timed by wrapping them: what they hold is counted as released). What worker threads cannot run in
    parallel, and what they take from a training step.

    where="worker thread": what one of 2 worker threads runs, its calls one after another in this thread (a batch
    opened: the plan, the shard read, the buffer and the draws; its chunks decoded; the batch ended; its buffer
    released, as the training process does once it has copied the batch out), and nothing else: each epoch's
    LoaderThreads is made (the epoch's plan drawn) by the training thread before the threads start, and its time is
    left out. where="one
    process": the whole loop with no workers (num_workers=0), the DataLoader's iteration, the loader's own
    bookkeeping and the consumer's loop over the batches included."""
    import itertools
    import time

    from fastpipe.loaders import cpu_ops, jpegcrop
    from fastpipe.loaders.threads import LoaderThreads

    inside = [0.0, 0.0]  # wall, this thread's CPU
    made = [0.0, 0.0]  # the same, making each epoch's LoaderThreads (the training thread's work)

    def timed(fn):
        def call(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t
                inside[1] += time.thread_time() - c
        return call

    torch.set_num_threads(1)
    threads = where == "worker thread"
    loader = make_loader(shards, "torch", batch_size=batch, image_size=224, num_workers=2 if threads else 0,
                         threads=True if threads else None, device="cpu", normalize=False)
    targets = [(cpu_ops.cv2, "resize"), (cpu_ops.cv2, "flip"), (cpu_ops.simplejpeg, "decode_jpeg")]
    pool = loader.dataset.prepare.buffers

    def thread_epoch(e):  # a worker thread's calls (threads.py), without the thread
        loader.dataset.epoch[0] = e
        t, c = time.perf_counter(), time.thread_time()
        work, n = LoaderThreads(loader.dataset, 2, loader.prefetch), 0
        made[0] += time.perf_counter() - t
        made[1] += time.thread_time() - c
        own = work._reader.shards
        for t in itertools.count():
            b = work._open(t)
            if b is None:
                return n
            for chunk in b.chunks:
                work._work(b, chunk, own)
            n += len(b.result.labels)
            pool.release(b.result.slot)
            b.result = None

    def run():
        n = 0
        for e in range(epochs):
            if threads:
                n += thread_epoch(e)
            else:
                loader.set_epoch(e)
                n += sum(len(x) for x, _ in loader)
        return n

    run()  # warm
    made[:] = [0.0, 0.0]
    saved = [(m, name, getattr(m, name)) for m, name in targets]
    for m, name, fn in saved:
        setattr(m, name, timed(fn))
    try:
        t, c, (rw, rc) = time.perf_counter(), time.thread_time(), jpegcrop.ext.released()
        images = run()
        wall, cpu = time.perf_counter() - t - made[0], time.thread_time() - c - made[1]
        rw, rc = (now - then for now, then in zip(jpegcrop.ext.released(), (rw, rc)))
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
        loader.close()
    held = wall - inside[0] - rw
    return {"images": images, "us_per_image": 1e6 * wall / images, "gil_held_us_per_image": 1e6 * held / images,
            "gil_held_share": held / wall,
            # the same from this thread's CPU time: what other work on the machine took of it left out
            "gil_held_cpu_share": 1 - (inside[1] + rc) / cpu}


WHERE = ("worker thread", "one process")


def paths_compared(shards: str, epochs: int, rounds: int, batch: int) -> dict:
    """gil_held with the C training path and with the Python per-sample path (jpegcrop.chunked off), in a worker
    thread and in one process, each round in a shuffled order; medians and ranges of each, and the paired ratios."""
    import platform
    import random
    import statistics

    from fastpipe.loaders import jpegcrop

    real = jpegcrop.chunked
    runs = {f"{path}, {where}": [] for path in ("C chunk", "Python per sample") for where in WHERE}
    for _ in range(rounds):
        for name in random.sample(list(runs), len(runs)):
            path, where = name.split(", ")
            jpegcrop.chunked = real if path == "C chunk" else (lambda: False)
            runs[name].append(gil_held(shards, epochs, batch, where))
        jpegcrop.chunked = real
    out = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "rounds": rounds,
           "batch": batch}
    for name, rs in runs.items():
        for key in ("us_per_image", "gil_held_us_per_image", "gil_held_share", "gil_held_cpu_share"):
            vals = [r[key] for r in rs]
            out[f"{name}: {key}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    for where in WHERE:
        c, p = runs[f"C chunk, {where}"], runs[f"Python per sample, {where}"]
        out[f"time per image, C ÷ Python (paired), {where}"] = statistics.median(
            a["us_per_image"] / b["us_per_image"] for a, b in zip(c, p))
    for name in runs:
        m, c = out[f"{name}: gil_held_share"], out[f"{name}: gil_held_cpu_share"]
        print(f"{name}: {out[f'{name}: us_per_image']['median']:.0f} µs an image, "
              f"{out[f'{name}: gil_held_us_per_image']['median']:.1f} µs ({m['median']:.1%}, {m['min']:.1%}–"
              f"{m['max']:.1%}) hold the GIL; of its CPU time {c['median']:.1%} ({c['min']:.1%}–{c['max']:.1%})")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gil", action="store_true", help="the GIL's share instead: µs per image that hold it")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --gil: the crop decoder's C training path (train_chunk) and its Python per-sample path, "
                         "in a worker thread and in one process, alternately, this many rounds")
    ap.add_argument("--batch", type=int, default=64, help="with --gil: the batch size")
    a = ap.parse_args(argv)
    if a.gil and a.rounds:
        res = paths_compared(a.shards, a.epochs, a.rounds, a.batch)
    elif a.gil:
        res = {where: gil_held(a.shards, a.epochs, a.batch, where) for where in WHERE}
        for where, r in res.items():
            print(f"{where}: {r['images']} images, {r['us_per_image']:.0f} µs each, of which "
                  f"{r['gil_held_us_per_image']:.1f} µs ({r['gil_held_share']:.1%}) hold the GIL")
    else:
        res = profile(a.shards, a.epochs)
        print(f"{res['images']} images, {res['total_us_per_image']:.0f} µs each under the profiler")
        for g, us in res["us_per_image"].items():
            print(f"  {g:<42} {us:8.1f} µs  {res['share'][g]:6.1%}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Where a loader worker's time goes: the torch backend's whole per-batch path run in this process
(num_workers=0, so the profiler sees it), grouped into decode, resize + flip, crop draws, machinery (plan, shard
reading, labels) and batch assembly.

    python benchmarks/profile_worker.py --shards OUT [--epochs 6] [--json bench-results/worker-profile.json]
    python benchmarks/profile_worker.py --shards OUT --gil   # the share of it that holds the GIL (worker threads)
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


def gil_held(shards: str, epochs: int) -> dict:
    """µs per image the worker's path holds the GIL: its wall time less the time inside the calls that release it
    (the crop decoder's decode and its training chunks, simplejpeg's decode, OpenCV's resize and flip), timed by
    wrapping them; no profiler. What
    worker threads cannot run in parallel, and where they queue on the GIL."""
    import time

    from fastpipe.loaders import cpu_ops, jpegcrop

    inside = [0.0]

    def timed(fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t
        return call

    torch.set_num_threads(1)
    loader = make_loader(shards, "torch", batch_size=64, image_size=224, num_workers=0, device="cpu",
                         normalize=False)
    targets = [(cpu_ops.cv2, "resize"), (cpu_ops.cv2, "flip"), (cpu_ops.simplejpeg, "decode_jpeg")]
    targets += [(jpegcrop.ext, n) for n in ("decode", "header", "train_chunk") if hasattr(jpegcrop.ext, n)]

    def run():
        n = 0
        for e in range(epochs):
            loader.set_epoch(e)
            n += sum(len(x) for x, _ in loader)
        return n

    run()  # warm
    saved = [(m, name, getattr(m, name)) for m, name in targets]
    for m, name, fn in saved:
        setattr(m, name, timed(fn))
    try:
        t = time.perf_counter()
        images = run()
        wall = time.perf_counter() - t
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
    return {"images": images, "us_per_image": 1e6 * wall / images,
            "gil_held_us_per_image": 1e6 * (wall - inside[0]) / images, "gil_held_share": 1 - inside[0] / wall}


def paths_compared(shards: str, epochs: int, rounds: int) -> dict:
    """gil_held with the C training path and with the Python per-sample path (jpegcrop.chunked off), alternating,
    each round in a shuffled order; medians and ranges of each, and the paired ratios."""
    import platform
    import random
    import statistics

    from fastpipe.loaders import jpegcrop

    real, runs = jpegcrop.chunked, {"C chunk": [], "Python per sample": []}
    for _ in range(rounds):
        for name in random.sample(list(runs), 2):
            jpegcrop.chunked = real if name == "C chunk" else (lambda: False)
            runs[name].append(gil_held(shards, epochs))
        jpegcrop.chunked = real
    out = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "rounds": rounds}
    for name, rs in runs.items():
        for key in ("us_per_image", "gil_held_us_per_image", "gil_held_share"):
            vals = [r[key] for r in rs]
            out[f"{name}: {key}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    c, p = runs["C chunk"], runs["Python per sample"]
    out["time per image, C ÷ Python (paired)"] = statistics.median(
        a["us_per_image"] / b["us_per_image"] for a, b in zip(c, p))
    for name in runs:
        m = out[f"{name}: gil_held_share"]
        print(f"{name}: {out[f'{name}: us_per_image']['median']:.0f} µs an image, "
              f"{out[f'{name}: gil_held_us_per_image']['median']:.1f} µs ({m['median']:.1%}, {m['min']:.1%}–"
              f"{m['max']:.1%}) hold the GIL")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gil", action="store_true", help="the GIL's share instead: µs per image that hold it")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --gil: the crop decoder's C training path (train_chunk) and its Python per-sample path, "
                         "alternately, this many rounds")
    a = ap.parse_args(argv)
    if a.gil and a.rounds:
        res = paths_compared(a.shards, a.epochs, a.rounds)
    elif a.gil:
        res = gil_held(a.shards, a.epochs)
        print(f"{res['images']} images, {res['us_per_image']:.0f} µs each, of which {res['gil_held_us_per_image']:.1f}"
              f" µs ({res['gil_held_share']:.1%}) hold the GIL")
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

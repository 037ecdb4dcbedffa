"""What the checks in front of the decoders cost: the header check (imageguard.check: a JPEG's marker segments
walked, nothing decoded) against the decode of a stored photo by each loader path, and the converter's second
sha256 of each photo (the `changed` check) against converting it.

    python benchmarks/bench_guards.py --rounds 9 --json docs/results/guards.json

Demo photos (fastpipe.convert.demo's generator): stored ones at 427 x 320 (a shard's short side 320), baseline and
progressive; camera-size ones at 1632 x 1224 for the converter. Each round times every variant once, in a
shuffled order, so drift in the machine's speed hits all alike; figures are medians over rounds with their range,
and each ratio is of the same round's times.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import time
from pathlib import Path

import numpy as np

from fastpipe.convert.demo import render
from fastpipe.convert.images import ImageSettings, process
from fastpipe.dataset import imageguard
from fastpipe.loaders import cpu_ops, jpegcrop


def photos(w: int, h: int, n: int, progressive: bool = False) -> list[bytes]:
    out = []
    for i in range(n):
        buf = io.BytesIO()
        render(("leaf_rust", "pipe_crack")[i % 2], w, h, i).save(buf, "JPEG", quality=90, progressive=progressive)
        out.append(buf.getvalue())
    return out


def per_photo(fn, data: list[bytes]) -> float:
    start = time.perf_counter()
    for d in data:
        fn(d)
    return (time.perf_counter() - start) / len(data)


def variants(stored: dict[str, list[bytes]], camera: list[bytes]) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for kind, data in stored.items():
        out[f"{kind}: header check"] = (lambda d: imageguard.check(d), data)
        for dec in ("simplejpeg", "pillow") + (("crop",) if jpegcrop.ext is not None else ()):
            out[f"{kind}: decode_train {dec}"] = (lambda d, dec=dec: cpu_ops.decode_train(d, 224, rng, decoder=dec),
                                                   data)
    out["camera: sha256"] = (lambda d: hashlib.sha256(d).hexdigest(), camera)
    out["camera: scan count (images.process's check)"] = (imageguard.jpeg_info, camera)
    out["camera: convert (images.process)"] = (lambda d: process(d, ImageSettings()), camera)
    return out


def spread(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--photos", type=int, default=60)
    ap.add_argument("--json", default="bench-results/guards.json")
    a = ap.parse_args(argv)
    stored = {"baseline": photos(427, 320, a.photos), "progressive": photos(427, 320, a.photos, True)}
    todo = variants(stored, photos(1632, 1224, max(4, a.photos // 10)))
    times = {k: [] for k in todo}
    for _ in range(a.rounds):
        for name in random.sample(list(todo), len(todo)):
            fn, data = todo[name]
            times[name].append(per_photo(fn, data))
    ratios = {}
    for kind in stored:
        for name in todo:
            if name.startswith(f"{kind}: decode_train"):
                check = times[f"{kind}: header check"]
                ratios[f"{name.split(': ')[1]} ({kind}): check / decode"] = spread(
                    [c / d for c, d in zip(check, times[name])])
    convert = times["camera: convert (images.process)"]
    ratios["converter: sha256 / convert"] = spread([s / c for s, c in zip(times["camera: sha256"], convert)])
    ratios["converter: scan count / convert"] = spread(
        [s / c for s, c in zip(times["camera: scan count (images.process's check)"], convert)])
    sizes = {**stored, "camera": todo["camera: sha256"][1]}
    result = {"seconds_per_photo": {k: spread(v) for k, v in times.items()}, "ratios": ratios,
              "sizes_bytes": {k: int(np.mean([len(d) for d in v])) for k, v in sizes.items()}, "rounds": a.rounds}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    for k, v in result["seconds_per_photo"].items():
        print(f"{k:45s} {v['median'] * 1e6:9.1f} µs ({v['min'] * 1e6:.1f}-{v['max'] * 1e6:.1f})")
    for k, v in ratios.items():
        print(f"{k:45s} {v['median']:.3%} ({v['min']:.3%}-{v['max']:.3%})")


if __name__ == "__main__":
    main()

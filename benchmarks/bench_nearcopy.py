"""The near-copy fingerprint, calibrated: recall of transformed copies and the rate of false pairs among distinct
photos per threshold, on pictures with a natural photo's spectrum (amplitude 1/f, random phases: unrelated
pictures, as the photos of a real collection are) and on demo photos (procedural leaves and pipes: one scene
drawn again and again, distinct photos of a class alike by construction); the search's time and memory on random
fingerprints; and the conversion's CPU time with and without fingerprints, on 8-megapixel demo photos.

    python benchmarks/bench_nearcopy.py --json docs/results/nearcopy.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from fastpipe.dataset import nearcopy

THRESHOLDS = (8, 12, 16, 20, 24, 28)


def natural(seed: int, size=(1632, 1224)) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    f = np.hypot(np.fft.rfftfreq(w)[None, :], np.fft.fftfreq(h)[:, None])
    f[0, 0] = 1
    chans = []
    for _ in range(3):
        a = np.fft.irfft2((rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) / f, s=(h, w))
        chans.append(np.clip(128 + 45 * (a - a.mean()) / a.std(), 0, 255))
    return Image.fromarray(np.stack(chans, -1).astype(np.uint8))


def jpeg(im: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    im.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def copies(im: Image.Image) -> dict[str, Image.Image]:
    w, h, s = im.width, im.height, 0.85 ** 0.5
    cw, ch = int(w * s), int(h * s)
    return {"1/2 size": im.resize((w // 2, h // 2), Image.Resampling.LANCZOS),
            "1/4 size": im.resize((w // 4, h // 4), Image.Resampling.LANCZOS),
            **{f"JPEG q{q}": Image.open(io.BytesIO(jpeg(im, q))) for q in (50, 75, 95)},
            "crop 85% (corner)": im.crop((0, 0, cw, ch)),
            "crop 85% (centre)": im.crop(((w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch)),
            "crop 85% (one side)": im.crop((w - int(w * 0.85), 0, w, h)),
            "brightness +15%": ImageEnhance.Brightness(im).enhance(1.15),
            "brightness -15%": ImageEnhance.Brightness(im).enhance(0.85),
            "horizontal flip": ImageOps.mirror(im)}


def fingerprint(data: bytes) -> np.ndarray:
    """As the converter takes it: from the photo converted (stored short side 320, JPEG quality 90)."""
    from fastpipe.convert import images

    settings = images.ImageSettings(320, 90)
    return images.fingerprint(images.process(data, settings).jpeg, settings)


def calibrate(pictures: list[tuple[str, Image.Image]]) -> dict:
    """Per threshold: each transform's recall (copy paired with its original) and the share of same-class pairs of
    distinct pictures that pair, both over the pictures that are not plain (nearcopy.PLAIN), which are counted."""
    originals = [fingerprint(jpeg(im)) for _, im in pictures]
    made = [(k, name, fingerprint(jpeg(c))) for k, (_, im) in enumerate(pictures) for name, c in copies(im).items()]
    fps = np.stack(originals + [f for _, _, f in made])
    found = {(a, b): d for a, b, d in nearcopy.pairs(fps, max(THRESHOLDS))}
    n, plain = len(originals), nearcopy.plain(fps)
    same = [(a, b) for a in range(n) for b in range(a + 1, n) if pictures[a][0] == pictures[b][0]
            and not (plain[a] or plain[b])]
    rows = {}
    for t in THRESHOLDS:
        recall = {}
        for j, (k, name, _) in enumerate(made):
            if not plain[k]:  # a plain picture is never paired, by design: counted apart
                recall.setdefault(name, []).append(found.get((k, n + j), 999) <= t)
        rows[t] = {"recall": {k: float(np.mean(v)) for k, v in recall.items()},
                   "false_pairs": sum(found.get(p, 999) <= t for p in same) / max(len(same), 1)}
    return {"pictures": n, "plain": int(plain[:n].sum()), "same_class_pairs": len(same), "by_threshold": rows}


def search(n: int, threshold: int) -> dict:
    """pairs() on n random fingerprints (every tenth with a planted copy): seconds and the peak memory it added."""
    rng = np.random.default_rng(0)
    fps = rng.integers(0, 2**63, size=(n, len(nearcopy.WINDOWS) + 1, nearcopy.WORDS), dtype=np.uint64)
    fps[:, -1] = [np.float64(4 / 3).view(np.uint64), 0, 0, 0]
    fps[1::10, 0] = fps[0::10, 3][: len(fps[1::10])]
    before, t = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    found = nearcopy.pairs(fps, threshold)
    seconds = time.perf_counter() - t
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"fingerprints": n, "seconds": seconds, "fingerprint_bytes": fps.nbytes, "added_peak_bytes": peak,
            "pairs": len(found)}


def conversion(photos: int, rounds: int) -> dict:
    """CPU seconds of `fastpipe shard --workers 0` (all of it in this process, so that the process's own CPU time
    is the whole conversion's) with --near-duplicates off and group, interleaved, on 8-megapixel demo photos."""
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.driver import ShardConfig, shard

    base = Path(tempfile.mkdtemp(prefix="fp-near-"))
    try:
        make_demo_data(DemoConfig(base / "raw", count=photos))
        cpu = {"off": [], "group": []}
        for r in range(rounds):
            for mode in (("off", "group") if r % 2 == 0 else ("group", "off")):
                out = base / f"out-{mode}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = os.times()
                shard(ShardConfig(base / "raw", out, workers=0, near_duplicates=mode))
                t1 = os.times()
                cpu[mode].append(sum(t1[:4]) - sum(t0[:4]))
        ratio = [g / o for g, o in zip(cpu["group"], cpu["off"])]
        return {"photos": photos, "rounds": rounds, "cpu_s": cpu, "group_over_off": ratio,
                "median_ratio": float(np.median(ratio))}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--natural", type=int, default=40, help="natural-statistics pictures")
    ap.add_argument("--demo", type=int, default=60, help="demo photos")
    ap.add_argument("--search", default="100000,1000000", help="fingerprint counts for the search's timing")
    ap.add_argument("--convert-photos", type=int, default=40)
    ap.add_argument("--convert-rounds", type=int, default=4)
    ap.add_argument("--json", default="bench-results/nearcopy.json")
    args = ap.parse_args(argv)
    from fastpipe.convert.demo import DemoConfig, make_demo_data

    res = {"command": " ".join(["python", *sys.argv]), "threshold_default": nearcopy.DEFAULT_THRESHOLD}
    res["natural"] = calibrate([("natural", natural(s)) for s in range(args.natural)])
    print("natural:", json.dumps(res["natural"]["by_threshold"][nearcopy.DEFAULT_THRESHOLD]), flush=True)
    with tempfile.TemporaryDirectory(prefix="fp-near-demo-") as tmp:
        make_demo_data(DemoConfig(Path(tmp), count=args.demo, width=1632, height=1224))
        demo = []
        for f in sorted(Path(tmp).rglob("*.jpg")):
            try:
                demo.append((f.parent.name, Image.open(f).convert("RGB")))
            except OSError:
                continue  # the demo's damaged files, on purpose
        res["demo"] = calibrate(demo)
    print("demo:", json.dumps(res["demo"]["by_threshold"][nearcopy.DEFAULT_THRESHOLD]), flush=True)
    res["search"] = [search(int(n), nearcopy.DEFAULT_THRESHOLD) for n in args.search.split(",")]
    print("search:", json.dumps(res["search"]), flush=True)
    res["conversion"] = conversion(args.convert_photos, args.convert_rounds)
    print("conversion:", json.dumps(res["conversion"]), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()

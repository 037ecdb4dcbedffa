"""Conversion throughput of `fastpipe shard` against the single-process bound, per worker count.

The bound is the same per-file work (read + decode with DCT scaling + Lanczos + JPEG encode) in one plain
loop, no pool, no hashing, no shard writing. Target: each worker count reaches >= 0.8 of workers x bound.

    python benchmarks/bench_convert.py --photos 120 --workers 1,2 --json bench-results/convert.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from fastpipe.convert.demo import DemoConfig, make_demo_data
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.convert.images import ImageSettings, process


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="folder of photos (default: generate demo photos)")
    ap.add_argument("--photos", type=int, default=120, help="demo photos to generate when --src is not given")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--short-side", type=int, default=320)
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is kept")
    ap.add_argument("--near-duplicates", default="group", help="as `fastpipe shard` (off: no fingerprints)")
    ap.add_argument("--json", default="bench-results/convert.json")
    return ap.parse_args(argv)


def bound(files: list[Path], settings: ImageSettings) -> float:
    start = time.perf_counter()
    for f in files:
        process(f.read_bytes(), settings)
    return len(files) / (time.perf_counter() - start)


def draft_comparison(files: list[Path], short_side: int) -> list[dict]:
    """JPEG DCT scaling (draft) before Lanczos: speed and PSNR against a full decode + Lanczos."""
    import io

    import numpy as np
    from PIL import Image

    sample, refs = [], []
    for f in files:
        enc = process(f.read_bytes(), ImageSettings(short_side=short_side))
        if not hasattr(enc, "size") or Image.open(f).getexif().get(0x0112):
            continue  # the demo's broken and EXIF-rotated photos are not what this compares
        im = Image.open(f).convert("RGB")
        refs.append(np.asarray(im.resize(enc.size, Image.Resampling.LANCZOS), dtype=np.float64))
        sample.append(f)
        if len(sample) == 20:
            break
    rows = []
    for gap in (1.0, 2.0, 1000.0):  # 1000: the draft never applies, i.e. a full decode
        settings = ImageSettings(short_side=short_side, quality=100, draft_gap=gap)
        start = time.perf_counter()
        encoded = [process(f.read_bytes(), settings) for f in sample]
        rate = len(sample) / (time.perf_counter() - start)
        mse = [np.mean((np.asarray(Image.open(io.BytesIO(e.jpeg)), dtype=np.float64) - r) ** 2)
               for e, r in zip(encoded, refs)]
        psnr = float(np.mean([10 * np.log10(255**2 / m) for m in mse]))
        rows.append({"draft_gap": "off" if gap > 100 else gap, "img_per_s": rate, "psnr_db": psnr})
    return rows


def run_shard(src: Path, workers: int, short_side: int, near: str) -> tuple[float, float, int, dict]:
    """(overall img/s, img/s of the conversion pass alone, images, phase seconds)."""
    out = Path(tempfile.mkdtemp(prefix="fp-bench-"))
    try:
        s = shard(ShardConfig(src, out, short_side=short_side, workers=workers, near_duplicates=near))
        return s.converted_now / s.seconds, s.converted_now / s.phases["convert"], s.converted_now, s.phases
    finally:
        shutil.rmtree(out)


def main(args) -> dict:
    tmp = None
    if args.src:
        src = Path(args.src)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="fp-photos-"))
        src = tmp / "raw"
        make_demo_data(DemoConfig(src, count=args.photos))
    files = sorted(p for p in src.rglob("*.jpg") if p.is_file())
    settings = ImageSettings(short_side=args.short_side)
    per_core = max(bound(files, settings) for _ in range(args.repeat))
    rows = []
    for w in [int(x) for x in args.workers.split(",")]:
        rate, steady, n, phases = max(run_shard(src, w, args.short_side, args.near_duplicates)
                                      for _ in range(args.repeat))
        rows.append({"workers": w, "near_duplicates": args.near_duplicates, "images": n, "img_per_s": rate,
                     "convert_pass_img_per_s": steady,
                     "bound_img_per_s": per_core * w, "ratio_of_bound": rate / (per_core * w),
                     "convert_pass_ratio": steady / (per_core * w), "phase_seconds": phases})
    print(f"single-process bound (decode + resize + encode): {per_core:.1f} img/s per core, {len(files)} photos")
    print(f"{'workers':>7} {'img/s':>8} {'bound':>8} {'ratio':>6} {'pass img/s':>11} {'pass ratio':>11}  fixed costs")
    for r in rows:
        p = r["phase_seconds"]
        print(f"{r['workers']:7d} {r['img_per_s']:8.1f} {r['bound_img_per_s']:8.1f} {r['ratio_of_bound']:6.2f} "
              f"{r['convert_pass_img_per_s']:11.1f} {r['convert_pass_ratio']:11.2f}  "
              f"pool start {p['start']:.2f} s, hashing {p['hash']:.2f} s, previews+manifest {p['finish']:.2f} s")
    drafts = draft_comparison(files, args.short_side)
    print("JPEG draft before Lanczos (quality 100 output, PSNR vs full decode + Lanczos, 20 photos):")
    for d in drafts:
        print(f"  draft_gap {d['draft_gap']!s:>4}: {d['img_per_s']:6.1f} img/s  {d['psnr_db']:.2f} dB")
    result = {"benchmark": "convert", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "photos": len(files), "short_side": args.short_side, "bound_per_core_img_per_s": per_core,
              "rows": rows, "draft": drafts}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if tmp:
        shutil.rmtree(tmp)
    return result


if __name__ == "__main__":
    main(parse_args())

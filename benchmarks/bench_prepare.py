"""How close a consumer without fastpipe gets to the model's input by following an export record's `prepare` steps
as written (Pillow, NumPy and OpenCV only): the pixels against fastpipe's own (`Predictor.inputs`: the converter's
image step, then the validation decode), per stored short side and image size, on demo photos.

    python benchmarks/bench_prepare.py --json docs/results/prepare.json
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageOps


def stored(data: bytes, short: int, quality: int, gap: float) -> bytes:
    """The record's first step, as written: DCT-scaled decode, orientation, RGB, Lanczos, JPEG."""
    im = Image.open(io.BytesIO(data))
    w, h = im.size
    tw, th = _short(w, h, short)
    if im.format == "JPEG" and (tw, th) != (w, h):
        im.draft(im.mode if im.mode in ("RGB", "L") else None, (int(tw * gap), int(th * gap)))
    im.load()
    im = ImageOps.exif_transpose(im)
    if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", rgba.size, (255,) * 4), rgba).convert("RGB")
    else:
        im = im.convert("RGB")
    if _short(*im.size, short) != im.size:
        im = im.resize(_short(*im.size, short), Image.Resampling.LANCZOS, reducing_gap=3.0)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, optimize=False, subsampling="4:2:0")
    return buf.getvalue()


def _short(w: int, h: int, short: int) -> tuple[int, int]:
    s = min(w, h)
    return (w, h) if s <= short else (max(1, round(w * short / s)), max(1, round(h * short / s)))


def val(jpeg: bytes, size: int, crop: float) -> np.ndarray:
    """The record's second step, as written: the centre box, DCT-scaled when it is twice the size, OpenCV resize."""
    im = Image.open(io.BytesIO(jpeg))
    w, h = im.size
    side = min(w, h) * crop
    x0, y0 = round((w - side) / 2), round((h - side) / 2)
    x1, y1 = max(round((w + side) / 2), x0 + 1), max(round((h + side) / 2), y0 + 1)
    if min(x1 - x0, y1 - y0) >= 2 * size:
        need = (math.ceil(w * size / (x1 - x0)), math.ceil(h * size / (y1 - y0)))
        d = next(d for d in (8, 4, 2, 1) if -(-w // d) >= need[0] and -(-h // d) >= need[1])
        im.draft("RGB", (-(-w // d), -(-h // d)))
    a = np.asarray(im.convert("RGB"))
    sx, sy = a.shape[1] / w, a.shape[0] / h
    box = a[round(y0 * sy) : round(y1 * sy), round(x0 * sx) : round(x1 * sx)]
    interp = cv2.INTER_AREA if min(box.shape[:2]) >= 2 * size else cv2.INTER_LINEAR
    return cv2.resize(box, (size, size), interpolation=interp)


def compare(files: list[Path], short: int, size: int, crop: float = 0.875) -> dict:
    from fastpipe.convert import images
    from fastpipe.loaders import cpu_ops
    from fastpipe.predict.photos import prepare

    settings, diffs = images.ImageSettings(short, 90), []
    for f in files:
        data = f.read_bytes()
        ours = prepare(data, settings)
        if not isinstance(ours, bytes):
            continue  # the converter rejects it (the demo set has a damaged photo on purpose)
        want = cpu_ops.decode_val(ours, size, crop, "auto")
        diffs.append(np.abs(want.astype(int) - val(stored(data, short, 90, 1.0), size, crop).astype(int)).ravel())
    d = np.concatenate(diffs)
    return {"short_side": short, "image_size": size, "photos": len(diffs), "max": int(d.max()),
            "p99_9": float(np.percentile(d, 99.9)), "mean": float(d.mean()), "identical": float(np.mean(d == 0))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=48)
    ap.add_argument("--json", default="bench-results/prepare.json")
    args = ap.parse_args(argv)
    from fastpipe.convert.demo import DemoConfig, make_demo_data

    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        make_demo_data(DemoConfig(Path(tmp) / "raw", count=args.photos, width=1632, height=1224))
        files = sorted((Path(tmp) / "raw").rglob("*.jpg"))
        rows = [compare(files, short, size) for short, size in ((64, 32), (256, 224), (320, 224), (512, 224))]
    for r in rows:
        print(f"stored {r['short_side']} -> {r['image_size']}: {r['photos']} photos, max {r['max']}, "
              f"p99.9 {r['p99_9']:g}, mean {r['mean']:.3f}, identical {r['identical']:.1%}")
    out = {"command": " ".join(["python", *sys.argv]), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How close a consumer without fastpipe gets to the model's input with the preparation every export ships
(OUT.prepare.py, fastpipe/predict/standalone.py: Pillow, NumPy and OpenCV only): the pixels against fastpipe's
own (`Predictor.inputs`: the converter's image step, then the validation decode), per stored short side and image
size, on demo photos.

    python benchmarks/bench_prepare.py --json docs/results/prepare.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from fastpipe.predict import standalone


def compare(files: list[Path], short: int, size: int, crop: float = 0.875) -> dict:
    from fastpipe.convert import images
    from fastpipe.loaders import cpu_ops
    from fastpipe.predict.photos import prepare

    settings, diffs, numpy_diffs = images.ImageSettings(short, 90), [], []
    standalone.CARD = {"convert": {"short_side": short, "quality": 90, "draft_gap": 1.0}, "image_size": size,
                       "val_crop": crop}
    for f in files:
        data = f.read_bytes()
        ours = prepare(data, settings)
        if not isinstance(ours, bytes):
            continue  # the converter rejects it (the demo set has a damaged photo on purpose)
        want = cpu_ops.decode_val(ours, size, crop, "auto").astype(int)
        theirs = standalone.validation(standalone.stored(data))
        cv2, sys.modules["cv2"] = sys.modules.get("cv2"), None  # as where OpenCV is not installed
        try:
            bare = standalone.validation(standalone.stored(data))
        finally:
            sys.modules["cv2"] = cv2
        diffs.append(np.abs(want - theirs.astype(int)).ravel())
        numpy_diffs.append(np.abs(want - bare.astype(int)).ravel())
    return {"short_side": short, "image_size": size, "photos": len(diffs), **summary(diffs),
            "without_opencv": summary(numpy_diffs)}


def summary(diffs: list) -> dict:
    d = np.concatenate(diffs)
    return {"max": int(d.max()), "p99_9": float(np.percentile(d, 99.9)), "mean": float(d.mean()),
            "identical": float(np.mean(d == 0))}


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
              f"p99.9 {r['p99_9']:g}, mean {r['mean']:.3f}, identical {r['identical']:.1%}; without OpenCV: max "
              f"{r['without_opencv']['max']}, p99.9 {r['without_opencv']['p99_9']:g}, "
              f"identical {r['without_opencv']['identical']:.1%}")
    out = {"command": " ".join(["python", *sys.argv]), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Photos prepared as this model's training photos were, and classified, without fastpipe: NumPy and Pillow (OpenCV
for the validation resize where installed, else the same filters in NumPy), ONNX Runtime (a .onnx) or torch (a
.pt2) for the model. `fastpipe export` writes this file beside the model as MODEL.prepare.py, with the model's
record in CARD; it is also the specification of each step, in code.

    python MODEL.prepare.py PHOTO...    one CSV row per photo: path, predicted, probability, then every class's
    import runpy; ns = runpy.run_path("MODEL.prepare.py"); ns["prepare"](paths)  # uint8 NCHW, what the graph takes
                                                                                    # ns["classify"](paths): (N, K)
"""

import csv
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

CARD = json.loads("{}")  # the model's record: written by fastpipe export
MODEL = ""  # the model file's name, beside this one


def stored(data: bytes) -> bytes:
    """What the converter stored for a photo: a DCT-scaled decode, the EXIF orientation, RGB, Lanczos down to the
    short side, a JPEG at the stored quality. A model trained on another tool's shards takes the photo as it is."""
    c = CARD.get("convert")
    if c is None:
        return data
    im = Image.open(io.BytesIO(data))
    w, h = im.size
    tw, th = _short(w, h, c["short_side"])
    if im.format == "JPEG" and (tw, th) != (w, h):  # libjpeg's scale: the smallest 1/1..1/8 keeping this size
        im.draft(im.mode if im.mode in ("RGB", "L") else None, (int(tw * c["draft_gap"]), int(th * c["draft_gap"])))
    im.seek(0)
    im.load()
    im = _rgb(ImageOps.exif_transpose(im))
    if _short(*im.size, c["short_side"]) != im.size:
        im = im.resize(_short(*im.size, c["short_side"]), Image.Resampling.LANCZOS, reducing_gap=3.0)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=c["quality"], optimize=False, subsampling="4:2:0")
    return buf.getvalue()


def _short(w: int, h: int, short: int) -> tuple:
    s = min(w, h)
    return (w, h) if s <= short else (max(1, round(w * short / s)), max(1, round(h * short / s)))


def _rgb(im: Image.Image) -> Image.Image:
    """Any mode to RGB: 16-bit and float values scaled (not clipped), transparency flattened onto white."""
    # convert/images.to_rgb, copied: this file imports nothing of fastpipe (test_predict checks they agree)
    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(im, dtype=np.float32)
        scale = 255.0 / 65535.0 if a.max(initial=0) > 255 else 1.0
        return Image.fromarray(np.clip(a * scale + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        rgba = (im.convert("LA") if im.mode == "La" else im).convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im.convert("RGB")


def validation(jpeg: bytes) -> np.ndarray:
    """Validation's centre crop of a stored photo, resized to the model's size: uint8 HWC RGB."""
    size, crop = CARD["image_size"], CARD["val_crop"]
    im = Image.open(io.BytesIO(jpeg))
    w, h = im.size
    side = min(w, h) * crop
    x0, y0 = round((w - side) / 2), round((h - side) / 2)
    x1, y1 = max(round((w - side) / 2 + side), x0 + 1), max(round((h - side) / 2 + side), y0 + 1)
    if im.format == "JPEG" and min(x1 - x0, y1 - y0) >= 2 * size:  # decoded DCT-scaled, the box still >= size
        need = (math.ceil(w * size / (x1 - x0)), math.ceil(h * size / (y1 - y0)))
        d = next(d for d in (8, 4, 2, 1) if -(-w // d) >= need[0] and -(-h // d) >= need[1])
        im.draft("RGB", (w // d, h // d))  # Pillow picks the largest 1/d with w // (asked) >= d: exactly this d
    a = np.asarray(im.convert("RGB"))
    sx, sy = a.shape[1] / w, a.shape[0] / h
    box = np.ascontiguousarray(a[round(y0 * sy) : round(y1 * sy), round(x0 * sx) : round(x1 * sx)])
    try:
        import cv2
    except ImportError:
        return resize(box, size)
    shrink = min(box.shape[:2]) >= 2 * size
    return cv2.resize(box, (size, size), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


def resize(box: np.ndarray, size: int) -> np.ndarray:
    """OpenCV's resize as the loader calls it, in NumPy: area averaging when the box is at least twice the output
    (INTER_AREA), else bilinear with half-pixel centres and clamped edges (INTER_LINEAR, its weights rounded to
    1/2048 as OpenCV's are for 8-bit photos); each output pixel rounded half up."""
    shrink = min(box.shape[:2]) >= 2 * size
    wy, wx = (_area(n, size) if shrink else _linear(n, size) for n in box.shape[:2])
    out = np.tensordot(wy, np.tensordot(wx, box.astype(np.float64), axes=(1, 1)), axes=(1, 1))
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)


def _area(n: int, size: int) -> np.ndarray:
    """(size, n): output pixel i averages input [i*n/size, (i+1)*n/size), each input pixel by its overlap."""
    edges, j = np.arange(size + 1) * (n / size), np.arange(n)
    return np.clip(np.minimum(edges[1:, None], j + 1) - np.maximum(edges[:-1, None], j), 0, None) * (size / n)


def _linear(n: int, size: int) -> np.ndarray:
    """(size, n): output pixel i at input (i + 0.5) * n / size - 0.5, between its two neighbours."""
    x = (np.arange(size) + 0.5) * (n / size) - 0.5
    x0 = np.floor(x).astype(int)
    f = np.where(x0 < 0, 0.0, np.round((x - x0) * 2048) / 2048)
    w, rows = np.zeros((size, n)), np.arange(size)
    np.add.at(w, (rows, np.clip(x0, 0, n - 1)), 1 - f)
    np.add.at(w, (rows, np.clip(x0 + 1, 0, n - 1)), f)
    return w


def prepare(paths) -> np.ndarray:
    """uint8 RGB NCHW at the model's size: what the exported graph takes."""
    return np.stack([validation(stored(Path(p).read_bytes())).transpose(2, 0, 1) for p in paths])


def classify(paths) -> np.ndarray:
    """Probabilities (N, classes), by the model beside this file."""
    x, model = prepare(paths), Path(__file__).with_name(MODEL)
    if model.suffix == ".onnx":
        import onnxruntime

        return onnxruntime.InferenceSession(str(model)).run(None, {"images": x})[0]
    import torch  # a .pt2 runs code as it loads: only one you trust

    return torch.export.load(str(model)).module()(torch.from_numpy(x)).numpy()


def main(argv) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    classes, out = CARD["classes"], csv.writer(sys.stdout)
    out.writerow(["path", "predicted", "probability", *classes])
    for path, p in zip(argv, classify(argv)):
        if CARD["task"] == "multilabel":
            picked = [c for c, s, t in zip(classes, p, CARD.get("thresholds") or [0.5] * len(classes)) if s >= t]
            out.writerow([path, ";".join(picked), "", *(f"{s:.6f}" for s in p)])
        else:
            out.writerow([path, classes[int(p.argmax())], f"{p.max():.6f}", *(f"{s:.6f}" for s in p)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

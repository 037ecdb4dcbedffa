"""Decode + crop + flip on uint8, on the CPU, one sample at a time (the loader workers' hot path).

Two decoders, same random draws, same output (uint8 HWC; the float conversion and normalisation happen on
the device, where they are free and the copy is 4x smaller):
- "simplejpeg": libjpeg-turbo through simplejpeg, crop as a NumPy view, cv2.resize (INTER_AREA when
  shrinking) and cv2.flip — the fastest per-core path measured here (DESIGN.md; benchmarks/bench_loaders.py).
- "pillow": one `Image.resize(box=...)` call after JPEG DCT scaling; for non-JPEG images, for colour spaces
  simplejpeg does not convert (CMYK), and where simplejpeg/OpenCV are not installed.
"auto" uses the first and falls back to the second per sample.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from fastpipe.errors import MissingDependency

RESAMPLE = Image.Resampling.BILINEAR  # Pillow's bilinear is antialiased when shrinking, like torchvision's
DECODERS = ("auto", "simplejpeg", "pillow")

try:
    import cv2
    import simplejpeg
except ImportError:  # the Pillow path does everything, slower
    cv2 = simplejpeg = None


def one_thread(_worker_id: int = 0) -> None:
    """In a loader worker: one worker = one core, so OpenCV's own thread pool would oversubscribe. Set in the
    workers only; the user's process keeps its OpenCV settings."""
    if cv2 is not None:
        cv2.setNumThreads(1)


_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))


def random_resized_crop_box(w: int, h: int, rng: np.random.Generator, min_scale: float = 0.08,
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (x0, y0, x1, y1): 10 tries, then a centre crop fallback."""
    area = w * h
    log_r = _LOG_RATIO if ratio == (3 / 4, 4 / 3) else (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(*log_r))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x0, y0, x0 + cw, y0 + ch
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


def center_crop_box(w: int, h: int, size: int, crop: float) -> tuple[int, int, int, int]:
    """Box that, resized to size x size, equals resize(short side = size / crop) + centre crop(size)."""
    side = min(w, h) * crop
    x0, y0 = (w - side) / 2, (h - side) / 2
    return round(x0), round(y0), round(x0 + side), round(y0 + side)


def _crop_resize(im: Image.Image, box, size: int) -> np.ndarray:
    """Decode with DCT scaling when it pays, then crop + resize in one call."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    if im.format == "JPEG" and min(bw, bh) >= 2 * size:
        w, h = im.size
        im.draft("RGB", (math.ceil(w * size / bw), math.ceil(h * size / bh)))
        sx, sy = im.size[0] / w, im.size[1] / h
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.asarray(im.resize((size, size), RESAMPLE, box=box))


def _fast(data: bytes, w: int, h: int, box, size: int, flip: bool, out: np.ndarray | None) -> np.ndarray:
    """simplejpeg decode (DCT-scaled when the crop is at least twice the output) + cv2 crop/resize/flip."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    scaled = min(bw, bh) >= 2 * size
    a = simplejpeg.decode_jpeg(data, "RGB", min_width=math.ceil(w * size / bw) if scaled else 0,
                               min_height=math.ceil(h * size / bh) if scaled else 0)
    sx, sy = a.shape[1] / w, a.shape[0] / h
    crop = a[round(box[1] * sy) : round(box[3] * sy), round(box[0] * sx) : round(box[2] * sx)]
    # INTER_AREA only where bilinear would alias (shrinking 2x or more): 3x slower than INTER_LINEAR.
    interp = cv2.INTER_AREA if min(crop.shape[:2]) >= 2 * size else cv2.INTER_LINEAR
    if not flip:
        return cv2.resize(crop, (size, size), dst=out, interpolation=interp)
    return cv2.flip(cv2.resize(crop, (size, size), interpolation=interp), 1, dst=out)


def _header(data: bytes, decoder: str):
    """(w, h, fast) — fast when simplejpeg can take this file."""
    if decoder != "pillow" and simplejpeg is not None:
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace in ("YCbCr", "Gray", "RGB"):
                return w, h, True
        except ValueError:
            pass  # not a JPEG (or a damaged header): Pillow decides
    if decoder == "simplejpeg" and simplejpeg is None:
        raise MissingDependency("decoder='simplejpeg' needs simplejpeg and opencv-python-headless installed")
    return *Image.open(io.BytesIO(data)).size, False


def _decode(data: bytes, size: int, box_of, decoder: str, out: np.ndarray | None) -> np.ndarray:
    w, h, fast = _header(data, decoder)
    box, flip = box_of(w, h)
    if fast:
        try:
            return _fast(data, w, h, box, size, flip, out)
        except ValueError:
            if decoder == "simplejpeg":
                raise
    img = _crop_resize(Image.open(io.BytesIO(data)), box, size)
    img = img[:, ::-1] if flip else img
    if out is None:
        return np.ascontiguousarray(img)
    out[...] = img
    return out


def decode_train(data: bytes, size: int, rng: np.random.Generator, min_scale: float = 0.08,
                 decoder: str = "auto", out: np.ndarray | None = None) -> np.ndarray:
    """RandomResizedCrop(size) + horizontal flip with probability 1/2 → uint8 HWC (into `out` if given:
    the loader decodes straight into its batch buffer, saving a copy per image)."""
    return _decode(data, size, lambda w, h: draw_train_params(w, h, rng, min_scale), decoder, out)


def decode_val(data: bytes, size: int, crop: float = 0.875, decoder: str = "auto",
               out: np.ndarray | None = None) -> np.ndarray:
    """Resize the short side to size / crop, centre crop size x size → uint8 HWC."""
    return _decode(data, size, lambda w, h: (center_crop_box(w, h, size, crop), False), decoder, out)


def draw_train_params(w: int, h: int, rng: np.random.Generator, min_scale: float = 0.08):
    """The same random draws as decode_train, for decoders that crop elsewhere (nvjpeg on the GPU)."""
    box = random_resized_crop_box(w, h, rng, min_scale)
    return box, bool(rng.random() < 0.5)


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(w, h) from the header alone."""
    w, h, _ = _header(data, "auto")
    return w, h

"""Decode + crop + flip on uint8, on the CPU, one sample at a time (the loader workers' hot path).

Crop and resize happen in one `Image.resize(box=...)` call (the fastest Pillow path per DESIGN.md), after
JPEG DCT scaling when the crop is at least twice the output size. The output stays uint8 HWC: the float
conversion and normalisation happen on the device, where they are free and the copy is 4x smaller.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

RESAMPLE = Image.Resampling.BILINEAR  # Pillow's bilinear is antialiased when shrinking, like torchvision's


def random_resized_crop_box(w: int, h: int, rng: np.random.Generator, min_scale: float = 0.08,
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (x0, y0, x1, y1): 10 tries, then a centre crop fallback."""
    area = w * h
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
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


def decode_train(data: bytes, size: int, rng: np.random.Generator, min_scale: float = 0.08) -> np.ndarray:
    """RandomResizedCrop(size) + horizontal flip with probability 1/2 → uint8 HWC."""
    im = Image.open(io.BytesIO(data))
    box, flip = draw_train_params(*im.size, rng, min_scale)
    out = _crop_resize(im, box, size)
    return np.ascontiguousarray(out[:, ::-1]) if flip else out


def decode_val(data: bytes, size: int, crop: float = 0.875) -> np.ndarray:
    im = Image.open(io.BytesIO(data))
    return _crop_resize(im, center_crop_box(*im.size, size, crop), size)


def draw_train_params(w: int, h: int, rng: np.random.Generator, min_scale: float = 0.08):
    """The same random draws as decode_train, for decoders that crop elsewhere (nvjpeg on the GPU)."""
    box = random_resized_crop_box(w, h, rng, min_scale)
    return box, bool(rng.random() < 0.5)


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(w, h) from the header alone."""
    return Image.open(io.BytesIO(data)).size

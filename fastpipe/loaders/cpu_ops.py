"""Decode + crop + flip on uint8, on the CPU, one sample at a time (the loader workers' hot path).

Three decoders, same random draws, same output (uint8 HWC; the float conversion and normalisation happen on
the device, where they are free and the copy is 4x smaller):
- "crop": fastpipe's C extension (jpegcrop.py) decodes only the box's part of the JPEG, DCT-scaled to 1/2, 1/4
  or 1/8 when the box is at least twice the output, then cv2.resize and cv2.flip as below. Its box pixels are
  those of a full decode; where it is not built, "auto" goes on with the next.
- "simplejpeg": libjpeg-turbo through simplejpeg, crop as a NumPy view, cv2.resize (INTER_AREA when
  shrinking) and cv2.flip — the fastest full-decode path measured here (benchmarks/bench_loaders.py).
- "pillow": one `Image.resize(box=...)` call after JPEG DCT scaling; for non-JPEG images, for colour spaces
  neither libjpeg path converts (CMYK), and where simplejpeg/OpenCV are not installed.
"auto" uses the first that can take each file and falls back to the next when it fails on it, so a sample
decodes (or fails) as it did with the full-decode path alone.

No decoder is given a file its header does not clear first (imageguard.py): more pixels than the data set's
max_pixels, or a JPEG of more scans than libjpeg-turbo's limit, raises `imageguard.Refused` (the loader skips and
counts the sample). The crop decoder reads the header itself and stops at the scan limit as it decodes; simplejpeg
and Pillow are given a file only after imageguard.check has walked its markers.
"""

from __future__ import annotations

import functools
import io
import math

import numpy as np
from PIL import Image

from fastpipe.dataset import imageguard
from fastpipe.dataset.imageguard import DEFAULT_MAX_PIXELS
from fastpipe.errors import MissingDependency
from fastpipe.loaders import jpegcrop

RESAMPLE = Image.Resampling.BILINEAR  # Pillow's bilinear is antialiased when shrinking, like torchvision's
DECODERS = ("auto", "crop", "simplejpeg", "pillow")

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
    x0, y0, x1, y1 = round(x0), round(y0), round(x0 + side), round(y0 + side)
    return x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)  # a photo 1 or 2 px thin rounds to an empty box otherwise


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


def _resize_flip(crop: np.ndarray, size: int, flip: bool, out: np.ndarray | None) -> np.ndarray:
    # INTER_AREA only where bilinear would alias (shrinking 2x or more): 3x slower than INTER_LINEAR.
    interp = cv2.INTER_AREA if min(crop.shape[:2]) >= 2 * size else cv2.INTER_LINEAR
    if not flip:
        return cv2.resize(crop, (size, size), dst=out, interpolation=interp)
    return cv2.flip(cv2.resize(crop, (size, size), interpolation=interp), 1, dst=out)


def _fast(data: bytes, w: int, h: int, box, size: int, flip: bool, out: np.ndarray | None) -> np.ndarray:
    """simplejpeg decode (DCT-scaled when the crop is at least twice the output) + cv2 crop/resize/flip."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    scaled = min(bw, bh) >= 2 * size
    a = simplejpeg.decode_jpeg(data, "RGB", min_width=math.ceil(w * size / bw) if scaled else 0,
                               min_height=math.ceil(h * size / bh) if scaled else 0)
    sx, sy = a.shape[1] / w, a.shape[0] / h
    crop = a[round(box[1] * sy) : round(box[3] * sy), round(box[0] * sx) : round(box[2] * sx)]
    return _resize_flip(crop, size, flip, out)


def _crop(data: bytes, w: int, h: int, box, size: int, flip: bool, out: np.ndarray | None,
          sampling) -> np.ndarray:
    """The crop decoder: the box alone, at the power-of-two scale that still covers the output (scale 1 for a sampling
    whose scaled crops this libjpeg-turbo gets wrong: jpegcrop.scaled_crops), then as _fast."""
    denom = jpegcrop.scale_for(w, h, box, size, sampling)
    sx, sy = -(-w // denom) / w, -(-h // denom) / h  # libjpeg's scaled size is rounded up
    crop = jpegcrop.decode_box(data, denom, (round(box[0] * sx), round(box[1] * sy), round(box[2] * sx),
                                             round(box[3] * sy)))
    return _resize_flip(crop, size, flip, out)


def _header(data: bytes, decoder: str, max_pixels: int):
    """(w, h, path, sampling): path is "crop", "fast" (simplejpeg) or "pillow", the first that can take this file;
    sampling (the crop decoder's) the JPEG's sampling factors. Raises imageguard.Refused for a file no decoder may
    touch."""
    if decoder in ("auto", "crop") and jpegcrop.ext is not None and cv2 is not None:
        try:
            w, h, ok, sampling = jpegcrop.header(data)
            if ok:
                imageguard.check_size(w, h, max_pixels)  # scans: the crop decoder stops at the limit itself
                return w, h, "crop", sampling
        except jpegcrop.Error:
            pass  # not a JPEG (or a damaged header): the paths below decide, as before
    elif decoder == "crop":
        jpegcrop.require()
        raise MissingDependency("decoder='crop' needs opencv-python-headless installed (it resizes the box)")
    seen = imageguard.check(data, max_pixels)  # what simplejpeg and Pillow would trust: pixels, scans
    if decoder != "pillow" and simplejpeg is not None:
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace in ("YCbCr", "Gray", "RGB"):
                return w, h, "fast", None
        except ValueError:
            pass  # not a JPEG (or a damaged header): Pillow decides
    if decoder == "simplejpeg" and simplejpeg is None:
        raise MissingDependency("decoder='simplejpeg' needs simplejpeg and opencv-python-headless installed")
    return *(seen or Image.open(io.BytesIO(data)).size), "pillow", None


def _decode(data: bytes, size: int, box_of, decoder: str, out: np.ndarray | None, max_pixels: int) -> np.ndarray:
    w, h, path, sampling = _header(data, decoder, max_pixels)
    box, flip = box_of(w, h)  # drawn once, whichever decoder ends up decoding: the draws never change
    if path == "crop":
        try:
            return _crop(data, w, h, box, size, flip, out, sampling)
        except jpegcrop.Error:
            if decoder == "crop":
                raise
            imageguard.check(data, max_pixels)  # before simplejpeg trusts it (the scan limit, say)
            path = "fast"  # a header the crop decoder read is one simplejpeg reads: it decides, as before
    if path == "fast":
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
                 decoder: str = "auto", out: np.ndarray | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """RandomResizedCrop(size) + horizontal flip with probability 1/2 → uint8 HWC (into `out` if given:
    the loader decodes straight into its batch buffer, saving a copy per image)."""
    return _decode(data, size, lambda w, h: draw_train_params(w, h, rng, min_scale), decoder, out, max_pixels)


def decode_val(data: bytes, size: int, crop: float = 0.875, decoder: str = "auto",
               out: np.ndarray | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Resize the short side to size / crop, centre crop size x size → uint8 HWC."""
    return _decode(data, size, lambda w, h: (center_crop_box(w, h, size, crop), False), decoder, out, max_pixels)


def draw_train_params(w: int, h: int, rng: np.random.Generator, min_scale: float = 0.08):
    """The same random draws as decode_train, for decoders that crop elsewhere (nvjpeg on the GPU)."""
    box = random_resized_crop_box(w, h, rng, min_scale)
    return box, bool(rng.random() < 0.5)


def decode_box(data: bytes, size: int, box, flip: bool, out: np.ndarray | None = None,
               max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A box and flip drawn elsewhere (the nvjpeg backend's workers) → uint8 HWC, by the "auto" decoders."""
    return _decode(data, size, lambda w, h: (box, flip), "auto", out, max_pixels)


def jpeg_size(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(w, h) from the header alone, after the checks every decoder's input passes (imageguard.check): the nvjpeg
    backend hands the device only files that passed them."""
    size = imageguard.check(data, max_pixels)
    return size or _header(data, "auto", max_pixels)[:2]


@functools.cache
def chunk_matches() -> bool:
    """Whether the crop decoder's C training path (jpegcrop.train_chunk) gives this installation's Python path's
    pixels on a check photo: its resize reproduces OpenCV's INTER_LINEAR, and another OpenCV build could differ
    (then every sample takes the Python path)."""
    from fastpipe.loaders.rng import SampleRng

    if cv2 is None or not jpegcrop.chunked():
        return False
    y, x = np.mgrid[0:75, 0:101]
    photo = cv2.imencode(".jpg", np.stack([x * 2, y * 3, (x + y) % 256], -1).astype(np.uint8))[1].tobytes()
    at = np.arange(6, dtype=np.int64)
    states, out = SampleRng.states((0, 0), at), np.zeros((6, 48, 48, 3), np.uint8)
    status = jpegcrop.train_chunk([photo] * 6, SampleRng.key_state((0, 0)), at, 48, 0.08, out, 1 << 30)
    return all(s == 0 and np.array_equal(o, decode_train(photo, 48, SampleRng.at(t), decoder="crop"))
               for s, o, t in zip(status, out, states))


def active(decoder: str = "auto") -> str:
    """Which decoder `decoder` runs on this installation, and why not the crop decoder where it is absent."""
    if decoder == "pillow" or cv2 is None:
        return "Pillow" + ("" if decoder == "pillow" else " (simplejpeg/OpenCV not installed)")
    if decoder == "simplejpeg":
        return "simplejpeg + OpenCV, full decode"
    if jpegcrop.ext is None:
        return f"simplejpeg + OpenCV, {jpegcrop.describe()}"
    return f"{jpegcrop.describe()} + OpenCV; simplejpeg and Pillow where it does not take a file"

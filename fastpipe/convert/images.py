"""Open, clean, downsample and re-encode one image. Pure functions: the parallel driver calls `process`.

Every failure becomes a `Rejected(reason, detail)`, never an exception, so one bad photo can't stop a
conversion. The reasons are a closed vocabulary (`REASONS`) that the summary and the tests count on.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from fastpipe.dataset import imageguard

# Closed list of rejection reasons; anything recorded in rejected.jsonl is one of these.
REASONS = (
    "empty",  # zero bytes
    "not-an-image",  # no image format recognised
    "truncated",  # the file ends before the image data does
    "corrupt",  # decoder error inside the data, or a JPEG of more scans than libjpeg-turbo's limit (imageguard.py)
    "too-large",  # more pixels than --max-pixels (decompression-bomb guard), or a file over --max-file-size
    "unreadable",  # OS error reading the file (permissions, I/O)
    "not-a-file",  # a named pipe, device or socket (never read: it could block or never end)
    "symlink-loop",  # a folder link back into the tree: not followed
    "bad-name",  # a file name that is not valid UTF-8; in a store, a key a URL would decode or normalise ('..', %)
    "no-class",  # a file not inside a class folder
    "other-split",  # beside SRC/train and SRC/val (e.g. SRC/test): only those two are converted
    "missing",  # a list row names a file that does not exist
    "outside-root",  # a list row's path escapes the list's folder, or its URL redirects to another origin
    "bad-row",  # a list row without a path and a label
    "bad-label",  # a list row whose label is not one (a 0/1 cell that is 2 or 'yes', a line break, a whole document)
    "duplicate",  # same bytes as another file of the same class: one copy is kept
    "label-conflict",  # same bytes under two different labels: all copies rejected
    "near-duplicate",  # a near-copy of another photo (--near-duplicates drop, or drop-from-val in SRC's val/)
    "changed",  # the file's bytes changed between planning (hashing) and converting (--on-change stop: the run stops)
)


@dataclass(frozen=True)
class ImageSettings:
    short_side: int = 320
    quality: int = 90
    max_pixels: int = imageguard.DEFAULT_MAX_PIXELS
    # DCT-scale JPEGs down to at least this multiple of the target, then Lanczos. Measured on demo photos
    # (3264x2448 -> 427x320): gap 1 converts 1.56x as fast as gap 2, within 0.15 dB PSNR of a full decode
    # (benchmarks/bench_convert.py, docs/results/convert.json).
    draft_gap: float = 1.0


@dataclass(frozen=True)
class Encoded:
    jpeg: bytes
    size: tuple[int, int]  # stored (w, h)
    orig_size: tuple[int, int]  # (w, h) as the photo is meant to be seen (after EXIF rotation)
    pixel_sum: tuple[float, float, float]  # per channel, 0..1 scale, for the data set's mean/std
    pixel_sumsq: tuple[float, float, float]
    mode: str = "RGB"  # the file's own colour mode (L, RGBA, P, CMYK, I;16...): what was converted to RGB


@dataclass(frozen=True)
class Rejected:
    reason: str
    detail: str


def target_size(w: int, h: int, short_side: int) -> tuple[int, int]:
    """Size with the shorter side `short_side`, aspect kept; never upscaled."""
    s = min(w, h)
    if s <= short_side:
        return w, h
    scale = short_side / s
    return max(1, round(w * scale)), max(1, round(h * scale))


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode to RGB. Transparency is flattened onto white, 16-bit/float data is scaled, not clipped."""
    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(im, dtype=np.float32)
        # 16-bit photos span 0..65535; a float or 32-bit image spanning only 0..255 is already 8-bit.
        scale = 255.0 / 65535.0 if a.max(initial=0) > 255 else 1.0
        return Image.fromarray(np.clip(a * scale + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        rgba = (im.convert("LA") if im.mode == "La" else im).convert("RGBA")  # Pillow has no La -> RGBA
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def _open_checked(data: bytes, settings: ImageSettings) -> Image.Image | Rejected:
    if not data:
        return Rejected("empty", "0 bytes")
    try:
        imageguard.jpeg_info(data)  # a JPEG's scans, before Pillow decodes them (its pixels: below)
    except imageguard.TooManyScans as e:
        return Rejected("corrupt", str(e))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        return Rejected("not-an-image", "no known image format")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return Rejected("too-large", str(e))
    except (OSError, SyntaxError, ValueError, IndexError, EOFError) as e:  # cut or damaged inside its header
        return _classify_decode_error(e)
    w, h = im.size
    if w * h > settings.max_pixels:
        return Rejected("too-large", f"{w}x{h} = {w * h} pixels > --max-pixels {settings.max_pixels}")
    return im


def _classify_decode_error(e: Exception) -> Rejected:
    msg = str(e)
    low = msg.lower()
    if "truncated" in low or "premature end" in low or "not enough data" in low:
        return Rejected("truncated", msg)
    return Rejected("corrupt", f"{type(e).__name__}: {msg}")


def _decode(im: Image.Image, settings: ImageSettings) -> Image.Image:
    """Decode (with DCT scaling for JPEG), apply EXIF orientation, convert to RGB, resize."""
    w, h = im.size
    tw, th = target_size(w, h, settings.short_side)
    if im.format == "JPEG" and (tw, th) != (w, h):
        gap = settings.draft_gap
        # draft() picks the largest 1/2, 1/4, 1/8 scale that keeps at least the requested size.
        im.draft(im.mode if im.mode in ("RGB", "L") else None, (int(tw * gap), int(th * gap)))
    im.seek(0)  # first frame of GIF/TIFF/MPO
    im.load()
    im = ImageOps.exif_transpose(im)
    im = to_rgb(im)
    # Orientation may have swapped the sides; target_size is symmetric in that respect.
    out = target_size(*im.size, settings.short_side)
    if out != im.size:
        im = im.resize(out, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return im


def process(data: bytes, settings: ImageSettings) -> Encoded | Rejected:
    """Bytes of any image file → a clean RGB JPEG and its statistics, or the reason it was refused."""
    opened = _open_checked(data, settings)
    if isinstance(opened, Rejected):
        return opened
    orig, mode = opened.size, opened.mode
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EXIF/ICC chatter on real camera files is not actionable
            if opened.getexif().get(0x0112) in (5, 6, 7, 8):  # orientations that turn the photo by 90°
                orig = orig[::-1]
            im = _decode(opened, settings)
    except (OSError, SyntaxError, ValueError, IndexError, EOFError) as e:
        return _classify_decode_error(e)
    except Image.DecompressionBombError as e:
        return Rejected("too-large", str(e))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=settings.quality, optimize=False, subsampling="4:2:0")
    pixel_sum, pixel_sumsq = channel_sums(im)
    return Encoded(jpeg=buf.getvalue(), size=im.size, orig_size=orig, pixel_sum=pixel_sum, pixel_sumsq=pixel_sumsq,
                   mode=mode)


def fingerprint(data: bytes, settings: ImageSettings) -> np.ndarray | None:
    """The photo's near-copy fingerprint (dataset/nearcopy.py) from a DCT-scaled decode, or None where it cannot be
    decoded (converting it will say why)."""
    from fastpipe.dataset import nearcopy

    opened = _open_checked(data, settings)
    if isinstance(opened, Rejected):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return nearcopy.fingerprint(opened)
    except (OSError, SyntaxError, ValueError, IndexError, EOFError, Image.DecompressionBombError):
        return None


_LEVELS = np.arange(256, dtype=np.float64) / 255.0


def channel_sums(im: Image.Image) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel sum and sum of squares of an RGB image's pixels on the 0..1 scale, from its histogram: exact
    (integer counts times levels), and a small fraction of the cost of summing a float copy of the pixels (about
    1.7 % of an image's conversion time against 15-19 % for the float copy: benchmarks/bench_peers.py)."""
    h = np.asarray(im.histogram(), dtype=np.float64).reshape(3, 256)
    return tuple(map(float, h @ _LEVELS)), tuple(map(float, h @ np.square(_LEVELS)))

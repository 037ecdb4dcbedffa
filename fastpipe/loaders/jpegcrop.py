"""The crop-aware JPEG decoder (fastpipe/_jpegcrop.c, built by `pip install` where a C compiler and libjpeg-turbo's
headers are present): it decodes only the part of the stored JPEG that a crop box covers, and stops after the
box's last row. Its pixels are those of a full decode with the same libjpeg-turbo settings, exactly (the box is
widened by a pixel for the upsampling at its edges; tests/test_jpegcrop.py checks every JPEG kind).

When the extension is absent, `ext` is None and `absent` says why; cpu_ops then decodes whole images as before.
Progressive and arithmetic-coded files go through it too: their entropy decoding is not skipped, but the IDCT
and colour work outside the box is (1.2x on the demo photos, benchmarks/bench_crop.py). CMYK/YCCK files are not
converted to RGB by it: cpu_ops hands them to Pillow, as before.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from pathlib import Path

import numpy as np

from fastpipe.dataset.imageguard import MAX_SCANS
from fastpipe.errors import MissingDependency

try:
    from fastpipe import _jpegcrop as ext

    absent = None
except ImportError as e:  # not built (no compiler or headers at install time), or libjpeg missing at run time
    ext, absent = None, f"extension not built: {e}"

RGB_SOURCES = ("YCbCr", "Gray", "RGB")  # what libjpeg converts to RGB; CMYK and YCCK are not
SCALES = (8, 4, 2)  # DCT scaling denominators with SIMD IDCTs: M/8 scalings were slower than a crop decode
# What the extension raises for a file it cannot decode (a ValueError naming what libjpeg found); absent, nothing.
Error = ext.Error if ext is not None else ValueError
_local = threading.local()  # a scratch buffer per thread: the decode runs without the GIL


# Chroma subsampling (a component's sampling factors against the largest) whose DCT-scaled crops equal a full
# decode's at every scale, on libjpeg-turbo 2.1.5 (tests/test_jpegcrop.py checks each one a JPEG may declare). Not 4x2
# and 2x4: before libjpeg-turbo 3.0.0, jpeg_crop_scanline() miscalculated those components' width when scaling, and
# the colour conversion read uninitialised memory (its 3.0.0 ChangeLog; boxes differed by up to 202 grey levels here).
# Such files are decoded at scale 1. A whole-image decode does not crop: simplejpeg's and Pillow's scaled decodes are
# right at any version (the same test compares them).
SCALED_CROPS = frozenset({(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (4, 1), (1, 4), (3, 2), (2, 3)})
FIXED_IN = (3, 0, 0)  # the libjpeg-turbo that scales 4x2 and 2x4 crops right


def scaled_crops(sampling) -> bool:
    """Whether a DCT-scaled crop of a JPEG with these sampling factors is a full decode's on the libjpeg-turbo in use
    (an unknown version is taken as an affected one)."""
    hs, vs = [h for h, _ in sampling], [v for _, v in sampling]
    if not sampling or min(hs + vs) < 1:
        return False
    ratios = {(max(hs) / h, max(vs) / v) for h, v in sampling}
    return ratios <= (SCALED_CROPS | {(4, 2), (2, 4)} if crops_fixed() else SCALED_CROPS)


@functools.cache
def crops_fixed() -> bool:
    """Whether the libjpeg-turbo in use is one that scales 4x2 and 2x4 crops right (FIXED_IN or later)."""
    return tuple(int(x) for x in (runtime_version() or "0").split(".")) >= FIXED_IN


@functools.cache
def runtime_version() -> str | None:
    """The libjpeg-turbo the extension runs with (its headers' may be another's): the version text inside the library
    file that holds jpeg_std_error, found with dladdr. None where that cannot be read."""
    if ext is None:
        return None
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                    ("saddr", ctypes.c_void_p)]

    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(Info)]
        info = Info()
        symbol = ctypes.cast(ctypes.CDLL(ext.__file__).jpeg_std_error, ctypes.c_void_p)  # through its own dependency
        return version_in(info.fname.decode()) if dladdr(symbol, ctypes.byref(info)) and info.fname else None
    except (OSError, AttributeError, UnicodeDecodeError):
        return None


def version_in(path) -> str | None:
    """The libjpeg-turbo version that a library file carries (also one linked statically into a module)."""
    try:
        found = re.search(rb"libjpeg-turbo version (\d+\.\d+\.\d+)", Path(path).read_bytes())
    except OSError:
        return None
    return found.group(1).decode() if found else None


def describe() -> str:
    """One line for doctor, describe() and benchmark JSON: which decoder runs, or why this one does not."""
    if ext is None:
        return f"full decode (crop decoder absent: {absent})"
    used, built = runtime_version() or "unknown", ext.LIBJPEG_TURBO_VERSION
    tail = ")" if used == built else f", built with {built})"
    return f"crop-aware (fastpipe._jpegcrop, libjpeg-turbo {used}{tail}"


def require() -> None:
    if ext is None:
        raise MissingDependency(f"cpu_decoder='crop' needs fastpipe's C extension, which is not available "
                                f"({absent}): install a C compiler and libjpeg-turbo's headers (Debian/Ubuntu: "
                                f"apt-get install gcc libjpeg62-turbo-dev; scripts/setup.sh does it) and reinstall "
                                f"fastpipe (pip install -e .), or use cpu_decoder='auto'")


def header(data) -> tuple[int, int, bool, tuple[tuple[int, int], ...]]:
    """(width, height, whether the crop decoder takes it, each component's sampling factors); raises Error for what
    is not a readable JPEG header."""
    w, h, colorspace, _progressive, _arithmetic, sampling = ext.header(data)
    return w, h, colorspace in RGB_SOURCES, sampling


def scale_for(w: int, h: int, box, size: int, sampling=((1, 1),)) -> int:
    """The DCT scaling denominator: the smallest decode that still gives the box at least `size` pixels a side,
    when the box is at least twice the output (as the full-decode path decides) and a scaled crop of this sampling
    is a full decode's on this libjpeg-turbo (scaled_crops), else 1."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    if min(bw, bh) < 2 * size or not scaled_crops(sampling):
        return 1
    need_w, need_h = math.ceil(w * size / bw), math.ceil(h * size / bh)  # what the full-decode path asks for
    return next((d for d in SCALES if -(-w // d) >= need_w and -(-h // d) >= need_h), 1)


def chunked() -> bool:
    """Whether this extension has train_chunk as this module calls it (one built before has not, or another
    train_chunk: `released` came with this one); cpu_ops.chunk_matches checks its pixels against the Python path's."""
    return ext is not None and hasattr(ext, "train_chunk") and hasattr(ext, "released")


def train_chunk(images, key: int, positions: np.ndarray, size: int, min_scale: float, out: np.ndarray,
                max_pixels: int, lo: int = 0, hi: int | None = None) -> bytes:
    """chunk_decoder's call for a list of each sample's bytes; returns the status of samples lo..hi."""
    spans = np.array([(i, 0, len(im)) for i, im in enumerate(images)], np.int64).reshape(-1, 3)
    status = bytearray(b"\x01") * len(images)
    hi = len(images) if hi is None else hi
    chunk_decoder(size, min_scale, max_pixels)(list(images), spans, key, positions, out, status, lo, hi)
    return bytes(status[lo:hi])


def chunk_decoder(size: int, min_scale: float, max_pixels: int):
    """The C training path for these settings: call(views, spans, key, positions, out, status, lo, hi) -> left.

    It decodes training samples lo..hi of a batch as cpu_ops.decode_train decodes them with the crop decoder and
    SampleRng.at(SampleRng.states(...)[i]), bit for bit (crop draws, box decode, OpenCV's INTER_LINEAR resize, flip),
    straight into out[i] (the batch's buffer: uint8, n x size x size x 3, C-contiguous), in one call that runs
    without the GIL. Sample i's bytes are views[s][a:b] for (s, a, b) = spans[i] (int64, n x 3; sliced in C: no
    Python object per sample). `key`: SampleRng.key_state of the batch's (seed, epoch); `positions`: the batch's,
    int64 (the C code mixes each into the key; another dtype is a TypeError). It sets status[i] (n bytes): 0 done, 1
    for the Python path (bytes outside their view, a file this path does not take, a decoding error, a box OpenCV
    shrinks with INTER_AREA), and returns how many of lo..hi are 1. The settings are bound here, once: a call from
    a loader thread runs no Python of its own."""
    return functools.partial(ext.train_chunk, size, min_scale, min(max_pixels, 1 << 62),  # a C long; C's limit is lower
                             MAX_SCANS, crops_fixed())


def decode_box(data, denom: int, box) -> np.ndarray:
    """The box (in the 1/denom-scaled image's pixels) as an RGB uint8 view (rows, cols, 3) of this thread's
    scratch buffer: valid until this thread's next call."""
    x0, y0, x1, y1 = box
    rows, cols = y1 - y0, x1 - x0
    need = rows * (cols + ext.ROW_SLACK) * 3
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.size < need:
        scratch = _local.scratch = np.empty(max(need, 1 << 20), np.uint8)
    dx, stride = ext.decode(data, denom, x0, y0, x1, y1, scratch, MAX_SCANS)
    return scratch[: rows * stride * 3].reshape(rows, stride, 3)[:, dx : dx + cols]

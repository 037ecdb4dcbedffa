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

import math
import threading

import numpy as np

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


def describe() -> str:
    """One line for doctor, describe() and benchmark JSON: which decoder runs, or why this one does not."""
    if ext is None:
        return f"full decode (crop decoder absent: {absent})"
    return f"crop-aware (fastpipe._jpegcrop, libjpeg-turbo {ext.LIBJPEG_TURBO_VERSION} headers)"


def require() -> None:
    if ext is None:
        raise MissingDependency(f"cpu_decoder='crop' needs fastpipe's C extension, which is not available "
                                f"({absent}): install a C compiler and libjpeg-turbo's headers (Debian/Ubuntu: "
                                f"apt-get install gcc libjpeg62-turbo-dev; scripts/setup.sh does it) and reinstall "
                                f"fastpipe (pip install -e .), or use cpu_decoder='auto'")


def header(data) -> tuple[int, int, bool]:
    """(width, height, whether the crop decoder takes it); raises Error for what is not a readable JPEG header."""
    w, h, colorspace, _progressive, _arithmetic = ext.header(data)
    return w, h, colorspace in RGB_SOURCES


def scale_for(w: int, h: int, box, size: int) -> int:
    """The DCT scaling denominator: the smallest decode that still gives the box at least `size` pixels a side,
    when the box is at least twice the output (as the full-decode path decides), else 1."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    if min(bw, bh) < 2 * size:
        return 1
    need_w, need_h = math.ceil(w * size / bw), math.ceil(h * size / bh)  # what the full-decode path asks for
    return next((d for d in SCALES if -(-w // d) >= need_w and -(-h // d) >= need_h), 1)


def decode_box(data, denom: int, box) -> np.ndarray:
    """The box (in the 1/denom-scaled image's pixels) as an RGB uint8 view (rows, cols, 3) of this thread's
    scratch buffer: valid until this thread's next call."""
    x0, y0, x1, y1 = box
    rows, cols = y1 - y0, x1 - x0
    need = rows * (cols + ext.ROW_SLACK) * 3
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.size < need:
        scratch = _local.scratch = np.empty(max(need, 1 << 20), np.uint8)
    dx, stride = ext.decode(data, denom, x0, y0, x1, y1, scratch)
    return scratch[: rows * stride * 3].reshape(rows, stride, 3)[:, dx : dx + cols]

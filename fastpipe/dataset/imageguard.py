"""What an image's header says, checked before any decoder touches the image: its pixels against the data set's
limit, and, for a JPEG, how many scans it holds.

Every decoder fastpipe calls (the crop decoder, simplejpeg, Pillow; in the loaders, the converter, `fastpipe index`
and `inspect --verify`) trusts the header to size its work, so a hostile header costs what it claims:
- a 2 KB JPEG whose frame says 60000 x 60000 asks for gigabytes (a progressive one keeps every coefficient);
- a progressive JPEG may repeat its scans (a 1.4 MB file of 12,601 scans is valid), and each scan is a pass over the
  whole image: minutes at 8192 x 8192 ("Two Issues with the JPEG Standard", libjpeg-turbo).
`check` refuses both from the header. A JPEG is read by walking its marker segments (lengths, and a C-speed search
through each scan's entropy-coded data for the next marker): nothing is decoded, a few tens of µs for a stored
photo. Other formats: Pillow's lazy open, which reads the header only.

MAX_SCANS is libjpeg-turbo's own practice: its fuzzers and TurboJPEG's `TJFLAG_LIMITSCANS` (2.1) refuse a file over
500 scans, and `djpeg -maxscans`/`jpegtran -maxscans` stop past the number given. Encoders write 10 (libjpeg's
progressive default) to a few dozen (mozjpeg's searched scan scripts).
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

from fastpipe.errors import DataError

MAX_SCANS = 500
DEFAULT_MAX_PIXELS = 200_000_000  # the converter's --max-pixels default, and the limit of a data set without one

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (DHT, JPG and DAC share the range)
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no length field
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # in entropy-coded data: not stuffing, restart or fill


class Refused(ValueError):
    """An image refused from its header, before any decoder touched it."""


class TooLarge(Refused):
    """More pixels than the data set's limit."""


class TooManyScans(Refused):
    """A JPEG with more scans than MAX_SCANS."""


@dataclass(frozen=True)
class JpegInfo:
    width: int
    height: int
    sampling: tuple[tuple[int, int], ...]  # each component's (horizontal, vertical) sampling factors
    progressive: bool
    scans: int


def jpeg_info(data) -> JpegInfo | None:
    """The frame and scan count of a JPEG by its marker segments; None when `data` does not start as a JPEG. Raises
    TooManyScans as soon as the count passes MAX_SCANS. A file damaged past its frame header is reported as far as it
    reads: the decoders find what is wrong with it."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    frame, progressive, scans, pos, end = None, False, 0, 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF or data[pos + 1] in (0x00, 0xFF):  # junk or fill bytes: on to the next marker
            found = _NEXT_MARKER.search(data, pos + 1)
            if found is None:
                break
            pos = found.start()
            continue
        marker, length = data[pos + 1], data[pos + 2] << 8 | data[pos + 3]
        if marker == 0xD9:
            break
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker in _SOF and frame is None:
            frame, progressive = _frame(data, pos + 4, min(pos + 2 + length, end)), marker in _PROGRESSIVE
        pos += 2 + length
        if marker == 0xDA:
            scans += 1
            if scans > MAX_SCANS:
                raise TooManyScans(f"a JPEG of more than {MAX_SCANS} scans (libjpeg-turbo's limit for untrusted "
                                   f"files): each scan is a pass over the whole image")
            found = _NEXT_MARKER.search(data, pos)
            if found is None:
                break
            pos = found.start()
    if frame is None:
        return None
    width, height, sampling = frame
    return JpegInfo(width, height, sampling, progressive, scans)


def _frame(data, start: int, stop: int) -> tuple[int, int, tuple[tuple[int, int], ...]] | None:
    """(width, height, sampling factors) of a frame header's body data[start:stop]."""
    if stop - start < 6:
        return None
    height, width, count = int.from_bytes(data[start + 1 : start + 3], "big"), \
        int.from_bytes(data[start + 3 : start + 5], "big"), data[start + 5]
    comps = data[start + 6 : min(stop, start + 6 + 3 * count)]
    return width, height, tuple((comps[k + 1] >> 4, comps[k + 1] & 15) for k in range(0, len(comps) - 2, 3))


def check(data, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int] | None:
    """(width, height) as the header says, after the checks: TooLarge over `max_pixels`, TooManyScans for a JPEG over
    MAX_SCANS. None when no image header is recognised (the decoders then fail on it as they would)."""
    info = jpeg_info(data)
    if info is not None:
        size = (info.width, info.height)
    elif len(data) >= 2 and data[0] == 0xFF and data[1] == 0xD8:
        return None  # a JPEG without a readable frame header
    else:
        size = _pillow_size(data)
    if size is not None:
        check_size(*size, max_pixels)
    return size


def data_set_limit(settings: dict) -> int:
    """A data set's max_pixels: the conversion's --max-pixels as its dataset.json records it (`fastpipe index`
    records its own), else the default (shards indexed before it was recorded)."""
    limit = settings.get("max_pixels", DEFAULT_MAX_PIXELS)
    if type(limit) is not int or limit < 1:
        raise DataError(f"dataset.json: settings.max_pixels should be a pixel count >= 1 (holds {limit!r}); re-run "
                        f"the conversion (`fastpipe shard` or `fastpipe index`) to rewrite it")
    return limit


def check_size(width: int, height: int, max_pixels: int) -> None:
    """TooLarge when a header's width x height is over `max_pixels`."""
    if width * height > max_pixels:
        raise TooLarge(f"{width}x{height} = {width * height} pixels, more than the limit of {max_pixels} "
                       f"(max_pixels)")


def _pillow_size(data) -> tuple[int, int] | None:
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's own bomb warning: the limit here is the data set's
            return Image.open(io.BytesIO(data)).size
    except Image.DecompressionBombError as e:  # twice Pillow's own limit: over ours too (its size is in the text)
        raise TooLarge(f"{e}") from None
    except Exception:  # not an image Pillow knows, or a damaged header: the decoders say which
        return None

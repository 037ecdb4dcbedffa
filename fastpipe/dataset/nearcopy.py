"""Near-copies of a photo: the same picture downscaled, recompressed, brightened or darkened, or cropped to 85 % of
its area or more. Each photo gets a fingerprint, 16 perceptual hashes of 256 bits: the whole picture's and 15
windows' (a 92 % square crop at 3 x 3 positions, an 85 % strip at 3 positions each way), each the signs of the
lowest 16 x 16 DCT frequencies (the DC left out) of a 32 x 32 grey thumbnail against their median (a pHash with
four times the usual frequencies: photos of one scene framed alike, such as a leaf centred on a background, differ
in them). The bits run from the lowest frequencies up, so a hash's first 64 bits are a coarse hash of their own. A
copy cropped from a photo has a whole-picture hash near one of that photo's window hashes; any two copies have
whole-picture hashes near each other. Two photos are near-copies when the closest such pair of hashes differs in
`threshold` bits or fewer.

The search is multi-index hashing (Norouzi et al.) on the coarse 64 bits: split into three parts, a pair within
COARSE bits has a part within COARSE // 3 bits, so each whole-picture hash looks up its parts' neighbours in tables
of every window's parts (one lookup a probe); only those candidates are compared on all 256 bits: sub-quadratic,
in NumPy.
"""

from __future__ import annotations

import io
import itertools
import zipfile
from functools import cache

import numpy as np
from PIL import Image, ImageOps

THUMB = 96  # the grey thumbnail every hash is taken from
HASH = 32  # each window is resized to HASH x HASH for its DCT
K = 16  # the K x K lowest frequencies
WORDS = 4  # 256 bits (255 frequencies and a zero)
DEFAULT_THRESHOLD = 16
# A copy cropped to 85 % of the width keeps its height: its width / height changes by at most that (the log of it)
MAX_SHAPE_CHANGE = float(np.log(1 / 0.84))
# A photo whose low frequencies are this weak (the median magnitude, about 0.06 grey levels of amplitude) has no
# structure a fingerprint can hold: a clean, evenly lit surface; its bits would be noise, so it is never paired
PLAIN = 16.0
# The first 64 bits of a near-copy's closest hash differ in at most this many for the search to find it (measured
# on copies of natural-spectrum pictures: at most 2; of demo photos: 3 at the 99th percentile, 8 once). Each part
# then is probed within one bit: 69 lookups a photo (radius 2, up to 8 bits: 762 lookups, 10x the time).
COARSE = 5
PARTS = ((0, 22), (22, 43), (43, 64))  # bit ranges of the three parts


def _windows() -> list[tuple[float, float, float, float]]:
    """(x0, y0, x1, y1) as fractions of the picture: the whole, then the crops a near-copy may have been cut as."""
    square = [(x, y, x + 0.92, y + 0.92) for y in (0, 0.04, 0.08) for x in (0, 0.04, 0.08)]
    strips = [(x, 0, x + 0.85, 1) for x in (0, 0.075, 0.15)] + [(0, y, 1, y + 0.85) for y in (0, 0.075, 0.15)]
    return [(0, 0, 1, 1), *square, *strips]


WINDOWS = _windows()


def thumbnail(im: Image.Image) -> tuple[np.ndarray, float]:
    """THUMB x THUMB grey, float64, from an opened photo: a JPEG decoded DCT-scaled (at least 2 x THUMB a side,
    so that a photo and its half- or quarter-size copy are thumbnailed alike), the EXIF orientation applied; and
    the photo's width / height (the thumbnail squares it away)."""
    if im.format == "JPEG":
        im.draft("L", (2 * THUMB, 2 * THUMB))
    im = ImageOps.exif_transpose(im)
    grey = im if im.mode == "L" else im.convert("L")
    return np.asarray(grey.resize((THUMB, THUMB), Image.Resampling.BILINEAR), dtype=np.float64), im.width / im.height


@cache
def _dct() -> np.ndarray:
    k, i = np.arange(K)[:, None], np.arange(HASH)[None, :]
    return np.cos(np.pi * (2 * i + 1) * k / (2 * HASH))  # the K lowest rows of DCT-II (scale is irrelevant to signs)


@cache
def _zigzag() -> np.ndarray:
    """The K x K frequencies but DC, lowest first (by u + v, then u)."""
    uv = sorted(((u, v) for u in range(K) for v in range(K)), key=lambda p: (p[0] + p[1], p[0]))[1:]
    return np.array([u * K + v for u, v in uv])


@cache
def _area(n: int, lo: float, hi: float) -> np.ndarray:
    """(HASH, n): averages of [lo, hi) of n pixels into HASH, each pixel weighted by its overlap."""
    edges, j = np.linspace(lo * n, hi * n, HASH + 1), np.arange(n)
    w = np.clip(np.minimum(edges[1:, None], j + 1) - np.maximum(edges[:-1, None], j), 0, None)
    return w / w.sum(1, keepdims=True)


def _coefficients(thumb: np.ndarray, window) -> np.ndarray:
    x0, y0, x1, y1 = window
    small = _area(thumb.shape[0], y0, y1) @ thumb @ _area(thumb.shape[1], x0, x1).T
    return (_dct() @ small @ _dct().T).ravel()[_zigzag()]  # 255 frequencies, DC left out (brightness)


def _phash(c: np.ndarray) -> np.ndarray:
    bits = c > np.median(c)
    return np.packbits(np.append(bits, False)).view(">u8").astype(np.uint64)


def fingerprint(im: Image.Image) -> np.ndarray:
    """(17, 4) uint64: the photo's 16 hashes (whole picture first), then its aspect ratio (a float64's bits) and
    whether it is plain (1: no structure at these frequencies, its bits noise: never paired)."""
    thumb, aspect = thumbnail(im)
    coefficients = [_coefficients(thumb, w) for w in WINDOWS]
    plain = np.median(np.abs(coefficients[0])) < PLAIN
    shape = np.array([np.float64(aspect).view(np.uint64), int(plain), 0, 0], dtype=np.uint64)
    return np.stack([*map(_phash, coefficients), shape])


def aspects(fps: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(fps[:, len(WINDOWS), 0]).view(np.float64)


def plain(fps: np.ndarray) -> np.ndarray:
    return fps[:, len(WINDOWS), 1] == 1


def threshold_of(settings: dict, near: dict | None = None) -> int:
    """The threshold a data set was converted with (its dataset.json: anyone's to edit), or the default."""
    bits = (near or {}).get("threshold", settings.get("near_threshold"))
    return bits if type(bits) is int and 0 <= bits <= 32 else DEFAULT_THRESHOLD


def popcount(x: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x)
    b = x.view(np.uint8).reshape(*x.shape, 8)
    return np.unpackbits(b, axis=-1).sum(-1)


def _part(h: np.ndarray, part: tuple[int, int]) -> np.ndarray:
    lo, hi = part
    return (h >> np.uint64(64 - hi)) & np.uint64((1 << (hi - lo)) - 1)


def _masks(bits: int, radius: int) -> np.ndarray:
    out = [0]
    for r in range(1, radius + 1):
        out += [sum(1 << b for b in c) for c in itertools.combinations(range(bits), r)]
    return np.array(out, dtype=np.uint64)


class Index:
    """The window hashes of a set of fingerprints, ready to be asked which of them a whole-picture hash may be near:
    per part of the coarse 64 bits, the windows sorted by that part with where each value starts (a table of 2^bits
    entries), so that a probe is one lookup."""

    def __init__(self, fps: np.ndarray):
        self.fps = fps
        self.stored = fps[:, : len(WINDOWS)].reshape(-1, WORDS)
        self.owner = np.repeat(np.arange(len(fps)), len(WINDOWS))
        self.shape, self.usable = np.log(aspects(fps)), ~plain(fps)
        self.parts = []
        for part in PARTS:
            keys = _part(self.stored[:, 0], part).astype(np.int64)
            counts = np.bincount(keys, minlength=1 << (part[1] - part[0]))
            self.parts.append((part, np.argsort(keys, kind="stable"), np.cumsum(counts) - counts, counts))

    def candidates(self, whole: np.ndarray):
        """(query index, stored window index) arrays, per probe, of every pair whose coarse hashes may be within
        COARSE bits (a pair may come more than once)."""
        for part, order, starts, counts in self.parts:
            q = _part(whole[:, 0], part)
            for mask in _masks(part[1] - part[0], COARSE // len(PARTS)):
                probe = (q ^ mask).astype(np.int64)
                lo, n = starts[probe], counts[probe]
                if n.any():
                    offset = np.repeat(lo - np.cumsum(n) + n, n)  # each hit's place within its range
                    yield np.repeat(np.arange(len(q)), n), order[offset + np.arange(n.sum())]

    def near(self, fps: np.ndarray, threshold: int):
        """(query index, stored photo index, bits) of every query photo's whole picture within `threshold` bits of a
        stored photo's window, both usable and of shapes a crop can make of each other."""
        whole, shape, usable = fps[:, 0], np.log(aspects(fps)), ~plain(fps)
        for qi, si in self.candidates(whole):
            d = popcount(whole[qi] ^ self.stored[si]).sum(1)
            owner = self.owner[si]
            keep = (d <= threshold) & usable[qi] & self.usable[owner]
            keep &= np.abs(shape[qi] - self.shape[owner]) <= MAX_SHAPE_CHANGE
            yield qi[keep], owner[keep], d[keep]


def pairs(fps: np.ndarray, threshold: int = DEFAULT_THRESHOLD) -> list[tuple[int, int, int]]:
    """(i, j, distance), i < j, linking every photo to those within `threshold` bits of it and of a shape a crop can
    make of it: fps is (N, 17, 4) uint64 (fingerprint's). Photos with the same fingerprint are linked to the first of
    them only (at 0 bits), and that one to the rest, so that a thousand copies of one picture cost one."""
    if len(fps) < 2:
        return []
    first, rep = np.unique(fps.reshape(len(fps), -1), axis=0, return_index=True, return_inverse=True)[1:]
    rep = first[rep.ravel()]  # each photo's representative: the first photo with its fingerprint
    flat = plain(fps)
    found: dict[tuple[int, int], int] = {(int(r), i): 0 for i, r in enumerate(rep) if r != i and not flat[i]}
    reps = np.flatnonzero(rep == np.arange(len(fps)))
    index = Index(fps[reps])
    for qi, si, d in index.near(fps[reps], threshold):
        for a, b, dist in zip(reps[qi].tolist(), reps[si].tolist(), d.tolist()):
            if a != b:
                key = (min(a, b), max(a, b))
                found[key] = min(found.get(key, 256), dist)
    return sorted((a, b, d) for (a, b), d in found.items())


def nearest(fps: np.ndarray, index: Index, threshold: int) -> list[tuple[int, int] | None]:
    """For each photo of fps, the indexed photo whose window its whole picture is closest to (within `threshold`
    bits) and how far: (index photo, bits), or None."""
    best: list[tuple[int, int] | None] = [None] * len(fps)
    for qi, si, d in index.near(fps, threshold):
        for a, b, dist in zip(qi.tolist(), si.tolist(), d.tolist()):
            if best[a] is None or dist < best[a][1]:
                best[a] = (b, dist)
    return best


def groups(n: int, near: list[tuple[int, int, int]]) -> list[list[int]]:
    """Connected groups of two or more photos (union-find over the pairs), each sorted, in order of first photo."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b, _ in near:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(root(i), []).append(i)
    return sorted((m for m in members.values() if len(m) > 1), key=lambda m: m[0])


def table(samples: list[tuple[str, str]], fps: dict[str, np.ndarray]) -> bytes:
    """fingerprints.npz: each (split, source path)'s fingerprint, for later comparisons without decoding again."""
    buf = io.BytesIO()
    np.savez(buf, split=np.array([s for s, _ in samples], dtype=str), path=np.array([p for _, p in samples], dtype=str),
             fingerprint=np.stack([fps[p] for _, p in samples]) if samples else np.zeros((0, len(WINDOWS) + 1, WORDS),
                                                                                            dtype=np.uint64))
    return buf.getvalue()


def read_table(data: bytes, limit: int = 2 << 30) -> tuple[list[str], list[str], np.ndarray]:
    """(splits, paths, fingerprints) of a fingerprints.npz, checked before anything is unpacked (its three members,
    their unpacked size within `limit`) and after (no pickled objects, text arrays of paths, the shapes as
    written); a ValueError saying what is wrong otherwise."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = {i.filename: i.file_size for i in z.infolist()}
        if set(members) != {"split.npy", "path.npy", "fingerprint.npy"} or sum(members.values()) > limit:
            raise ValueError(f"members {sorted(members)[:5]} of {sum(members.values())} bytes unpacked")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            split, path, fps = z["split"], z["path"], z["fingerprint"]
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a fingerprint table fastpipe wrote ({type(e).__name__}: {e})") from None
    texts = all(a.ndim == 1 and a.dtype.kind == "U" and a.dtype.itemsize <= 4 * 4096 for a in (split, path))
    if not texts or fps.dtype != np.uint64 or fps.shape[1:] != (len(WINDOWS) + 1, WORDS) or \
            not len(split) == len(path) == len(fps):
        raise ValueError(f"fingerprints of shape {fps.shape} ({fps.dtype}) for paths {path.shape} ({path.dtype}): "
                         f"not fastpipe's")
    return split.tolist(), path.tolist(), fps

"""JPEG files no library here writes: any sampling factors a frame header may declare (4x2, 2x4, 3x1, ...), and
progressive files that repeat their scans. A small baseline encoder (integer-exact enough for decoders to agree
to the grey level: what the tests compare is decoders against each other, never against this encoder), with
its own valid Huffman tables (every symbol one code length: simple, and any decoder takes them)."""

from __future__ import annotations

import numpy as np

_DC_SYMBOLS, _AC_SYMBOLS = list(range(12)), [0x00, 0xF0] + [r << 4 | s for r in range(16) for s in range(1, 11)]
_DC_BITS, _AC_BITS = 4, 8  # 12 codes of 4 bits, 162 of 8: canonical codes 0, 1, 2, ...
_ZIGZAG = sorted(((u, v) for u in range(8) for v in range(8)), key=lambda p: (p[0] + p[1], p[0] if (p[0] + p[1]) % 2
                                                                              else p[1]))
_ZZ = np.array([u * 8 + v for u, v in _ZIGZAG])
_BASE_Q = (np.array([  # the JPEG standard's example tables (Annex K), luma then chroma
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99]),
    np.array([17, 18, 24, 47, 99, 99, 99, 99, 18, 21, 26, 66, 99, 99, 99, 99, 24, 26, 56, 99, 99, 99, 99, 99,
              47, 66, 99, 99, 99, 99, 99, 99] + [99] * 32))
_C = np.array([[np.sqrt((1 if u == 0 else 2) / 8) * np.cos((2 * x + 1) * u * np.pi / 16) for x in range(8)]
               for u in range(8)])


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


def _tables(quality: int) -> list[np.ndarray]:
    scale = 5000 / quality if quality < 50 else 200 - 2 * quality
    return [np.clip((q * scale + 50) // 100, 1, 255).astype(int) for q in _BASE_Q]


def _planes(rgb: np.ndarray, sampling, mcu: tuple[int, int]) -> list[np.ndarray]:
    """Each component's level-shifted plane, padded to whole MCUs and averaged down to its sampling."""
    h, w = rgb.shape[:2]
    ph, pw = -(-h // mcu[1]) * mcu[1], -(-w // mcu[0]) * mcu[0]
    x = np.pad(rgb.astype(float), ((0, ph - h), (0, pw - w), (0, 0)), mode="edge")
    if len(sampling) == 1:
        comps = [x.mean(2) if x.shape[2] == 3 else x[..., 0]]
    else:
        r, g, b = x[..., 0], x[..., 1], x[..., 2]
        comps = [0.299 * r + 0.587 * g + 0.114 * b, -0.168736 * r - 0.331264 * g + 0.5 * b + 128,
                 0.5 * r - 0.418688 * g - 0.081312 * b + 128]
    hmax, vmax = max(s[0] for s in sampling), max(s[1] for s in sampling)
    out = []
    for c, (hs, vs) in zip(comps, sampling):
        fy, fx = vmax // vs, hmax // hs
        out.append(c.reshape(ph // fy, fy, pw // fx, fx).mean((1, 3)) - 128)
    return out


def _blocks(plane: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Quantised DCT coefficients in zigzag order, shape (block rows, block columns, 64)."""
    by, bx = plane.shape[0] // 8, plane.shape[1] // 8
    b = plane.reshape(by, 8, bx, 8).transpose(0, 2, 1, 3)
    coef = np.einsum("ux,abxy,vy->abuv", _C, b, _C).reshape(by, bx, 64)
    return np.round(coef / q).astype(int)[..., _ZZ]


class _Bits:
    def __init__(self):
        self.parts: list[str] = []

    def put(self, value: int, length: int) -> None:
        if length:
            self.parts.append(format(value, f"0{length}b"))

    def number(self, v: int) -> int:
        """Huffman category of v, with v's bits written after the code by the caller."""
        return abs(v).bit_length()

    def value(self, v: int, size: int) -> None:
        self.put(v if v >= 0 else v + (1 << size) - 1, size)

    def bytes(self) -> bytes:
        bits = "".join(self.parts)
        bits += "1" * (-len(bits) % 8)
        raw = int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""
        return raw.replace(b"\xff", b"\xff\x00")


def _block(out: _Bits, zz: list[int], prev: int, dc_only: bool) -> int:
    size = out.number(zz[0] - prev)
    out.put(_DC_SYMBOLS.index(size), _DC_BITS)
    out.value(zz[0] - prev, size)
    if dc_only:
        return zz[0]
    run = 0
    for v in zz[1:]:
        if v == 0:
            run += 1
            continue
        while run > 15:
            out.put(_AC_SYMBOLS.index(0xF0), _AC_BITS)
            run -= 16
        size = out.number(v)
        out.put(_AC_SYMBOLS.index(run << 4 | size), _AC_BITS)
        out.value(v, size)
        run = 0
    if run:
        out.put(_AC_SYMBOLS.index(0x00), _AC_BITS)
    return zz[0]


def _scan_data(coefs: list[np.ndarray], sampling, dc_only: bool) -> bytes:
    out, prev = _Bits(), [0] * len(coefs)
    rows, cols = coefs[0].shape[0] // sampling[0][1], coefs[0].shape[1] // sampling[0][0]
    for my in range(rows):
        for mx in range(cols):
            for k, (c, (hs, vs)) in enumerate(zip(coefs, sampling)):
                for y in range(vs):
                    for x in range(hs):
                        prev[k] = _block(out, c[my * vs + y, mx * hs + x].tolist(), prev[k], dc_only)
    return out.bytes()


def _huffman(table_class: int, ident: int, length: int, symbols: list[int]) -> bytes:
    counts = [0] * 16
    counts[length - 1] = len(symbols)
    return bytes([table_class << 4 | ident, *counts, *symbols])


def encode(rgb: np.ndarray, sampling=((2, 2), (1, 1), (1, 1)), quality: int = 90, scans: int = 0,
           size: tuple[int, int] | None = None) -> bytes:
    """A JPEG of `rgb` (H x W x 3 uint8) with these sampling factors (one pair: grayscale). `scans` > 0 makes a
    progressive file of the DC coefficients only, its DC scan written `scans` times (libjpeg decodes each again, and
    warns of nothing: a valid file). `size` (w, h) is what the frame header says instead of the real size."""
    hmax, vmax = max(s[0] for s in sampling), max(s[1] for s in sampling)
    qs = _tables(quality)
    planes = _planes(rgb, sampling, (8 * hmax, 8 * vmax))
    coefs = [_blocks(p, qs[min(k, 1)]) for k, p in enumerate(planes)]
    h, w = rgb.shape[:2]
    w, h = size or (w, h)
    comps = b"".join(bytes([k + 1, hs << 4 | vs, min(k, 1)]) for k, (hs, vs) in enumerate(sampling))
    head = [b"\xff\xd8", _segment(0xDB, b"".join(bytes([t]) + bytes(q[_ZZ].tolist()) for t, q in enumerate(qs))),
            _segment(0xC2 if scans else 0xC0, bytes([8]) + h.to_bytes(2, "big") + w.to_bytes(2, "big")
                     + bytes([len(sampling)]) + comps)]
    for t in range(min(len(sampling), 2)):
        head.append(_segment(0xC4, _huffman(0, t, _DC_BITS, _DC_SYMBOLS) + _huffman(1, t, _AC_BITS, _AC_SYMBOLS)))
    sos = _segment(0xDA, bytes([len(sampling)]) + b"".join(bytes([k + 1, min(k, 1) * 0x11])
                                                           for k in range(len(sampling)))
                   + (b"\x00\x00\x00" if scans else b"\x00\x3f\x00"))
    body = sos + _scan_data(coefs, sampling, dc_only=bool(scans))
    return b"".join(head) + body * max(scans, 1) + b"\xff\xd9"

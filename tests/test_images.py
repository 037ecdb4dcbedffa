"""One image in, one clean RGB JPEG (or a reason) out."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fastpipe.convert.images import REASONS, ImageSettings, Rejected, process, target_size

S = ImageSettings(short_side=32, quality=95)


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def decoded(result) -> np.ndarray:
    assert not isinstance(result, Rejected), result
    im = Image.open(io.BytesIO(result.jpeg))
    assert im.format == "JPEG" and im.mode == "RGB"
    return np.asarray(im).astype(int)


def test_target_size_keeps_aspect_and_never_upscales():
    assert target_size(3264, 2448, 320) == (427, 320)
    assert target_size(2448, 3264, 320) == (320, 427)
    assert target_size(200, 100, 320) == (200, 100)


@pytest.mark.parametrize("mode", ["L", "1", "P", "CMYK", "RGB", "LA", "RGBA", "I;16", "I", "F"])
def test_every_mode_becomes_rgb(mode):
    base = Image.new("RGB", (64, 48), (200, 100, 50))
    fmt = "PNG" if mode in ("LA", "RGBA", "I;16", "P", "1") else "TIFF" if mode in ("I", "F") else "JPEG"
    src = base.convert(mode) if mode not in ("I;16", "I", "F") else Image.new(mode, (64, 48), 30000)
    out = decoded(process(encode(src, fmt), S))
    assert out.shape == (32, 43, 3)  # 64x48 → short side 32


def test_sixteen_bit_is_scaled_not_clipped():
    im = Image.new("I;16", (40, 40), 32768)  # mid-grey in 16 bits
    px = decoded(process(encode(im, "PNG"), S)).mean()
    assert 120 < px < 136  # clipping would give 255


def test_transparency_is_flattened_onto_white():
    rgba = Image.new("RGBA", (40, 40), (255, 0, 0, 0))  # fully transparent red
    assert decoded(process(encode(rgba, "PNG"), S)).min() > 240
    pal = Image.new("P", (40, 40), 0)
    pal.putpalette([0, 0, 0] * 256)
    pal.info["transparency"] = 0
    assert decoded(process(encode(pal, "PNG", transparency=0), S)).min() > 240


def test_first_frame_of_animated_gif_and_multipage_tiff():
    frames = [Image.new("RGB", (40, 40), c) for c in [(250, 0, 0), (0, 0, 250)]]
    for fmt in ("GIF", "TIFF"):
        data = encode(frames[0], fmt, save_all=True, append_images=frames[1:])
        px = decoded(process(data, S)).reshape(-1, 3).mean(0)
        assert px[0] > 200 and px[2] < 60, fmt


def test_exif_orientation_is_applied():
    im = Image.new("RGB", (80, 40), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 20, 20))  # red marker top-left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to view"
    res = process(encode(im, "JPEG", exif=exif, quality=95), ImageSettings(short_side=40))
    out = decoded(res)
    assert out.shape[:2] == (80, 40)  # now portrait
    assert res.orig_size == (40, 80)
    assert out[5, 35, 0] > 200 and out[5, 35, 2] < 80  # the marker moved to the top-right


def test_downsample_uses_jpeg_draft_and_keeps_content():
    im = Image.new("RGB", (1600, 1200), (10, 200, 10))
    res = process(encode(im, "JPEG", quality=90), ImageSettings(short_side=100))
    out = decoded(res)
    assert out.shape == (100, 133, 3) and res.orig_size == (1600, 1200)
    assert abs(out[..., 1].mean() - 200) < 6


def test_stats_are_over_the_stored_pixels():
    res = process(encode(Image.new("RGB", (40, 40), (255, 0, 0)), "PNG"), S)
    n = res.size[0] * res.size[1]
    assert res.pixel_sum[0] / n == pytest.approx(1.0, abs=0.02)
    assert res.pixel_sum[2] / n == pytest.approx(0.0, abs=0.02)


@pytest.mark.parametrize("data,reason", [
    (b"", "empty"),
    (b"this is not an image at all", "not-an-image"),
])
def test_rejections_of_non_images(data, reason):
    assert process(data, S) == Rejected(reason, process(data, S).detail)


@pytest.mark.parametrize("cut", [4, 40, 120, 300, 0.5])
def test_truncated_jpeg_is_rejected_wherever_it_is_cut(cut):
    """Cut inside its header (the first few hundred bytes) it raised from Image.open and stopped the conversion."""
    data = encode(Image.effect_noise((300, 200), 60).convert("RGB"), "JPEG")
    res = process(data[: int(len(data) * cut) if cut < 1 else cut], S)
    assert isinstance(res, Rejected) and res.reason in ("truncated", "corrupt", "not-an-image"), res


def test_corrupt_jpeg_is_rejected():
    data = bytearray(encode(Image.effect_noise((300, 200), 60).convert("RGB"), "JPEG"))
    mid = len(data) // 2
    data[mid : mid + 2000] = np.random.default_rng(0).bytes(2000)  # garbage inside the entropy-coded data
    res = process(bytes(data), S)
    assert isinstance(res, Rejected) and res.reason == "corrupt"


def test_decompression_bomb_is_refused_by_pixel_count():
    data = encode(Image.new("L", (5000, 5000)), "PNG")
    res = process(data, ImageSettings(short_side=32, max_pixels=10_000_000))
    assert isinstance(res, Rejected) and res.reason == "too-large"


def test_reasons_are_a_closed_list():
    assert len(set(REASONS)) == len(REASONS)

"""The workers' decode + crop + flip: both decoders, the same random draws, the same picture."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fastpipe.loaders import cpu_ops


def jpeg(w=200, h=150, fmt="JPEG") -> bytes:
    x = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
    x[..., 1] = np.linspace(0, 255, h)[:, None]  # horizontal and vertical ramps: crops and flips show
    buf = io.BytesIO()
    Image.fromarray(x.astype(np.uint8)).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def test_random_resized_crop_box_stays_inside_and_in_range():
    rng = np.random.default_rng(0)
    for _ in range(500):
        x0, y0, x1, y1 = cpu_ops.random_resized_crop_box(427, 320, rng, 0.08)
        assert 0 <= x0 < x1 <= 427 and 0 <= y0 < y1 <= 320
        assert (x1 - x0) * (y1 - y0) >= 0.08 * 427 * 320 * 0.95


def test_center_crop_box_matches_resize_then_crop():
    assert cpu_ops.center_crop_box(400, 300, 224, 0.875) == (69, 19, 331, 281)


@pytest.mark.parametrize("split", ["train", "val"])
def test_decoders_agree(split):
    data = jpeg()
    if split == "train":
        a = cpu_ops.decode_train(data, 64, np.random.default_rng(3), decoder="simplejpeg")
        b = cpu_ops.decode_train(data, 64, np.random.default_rng(3), decoder="pillow")
    else:
        a, b = (cpu_ops.decode_val(data, 64, decoder=d) for d in ("simplejpeg", "pillow"))
    assert a.shape == b.shape == (64, 64, 3) and a.dtype == b.dtype == np.uint8
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 4


def test_flip_mirrors_the_crop():
    data = jpeg()
    for seed in range(20):
        rng = np.random.default_rng(seed)
        _box, flip = cpu_ops.draw_train_params(200, 150, np.random.default_rng(seed))
        out = cpu_ops.decode_train(data, 32, rng).astype(int)
        assert (out[:, 0, 0].mean() > out[:, -1, 0].mean()) == flip  # the red ramp runs the other way


def test_png_falls_back_to_pillow_and_large_crops_use_dct_scaling():
    png = jpeg(fmt="PNG")
    assert cpu_ops.decode_val(png, 32).shape == (32, 32, 3)
    big = jpeg(1600, 1200)
    out = cpu_ops.decode_val(big, 64)
    assert out.shape == (64, 64, 3) and abs(out[..., 0].mean() - 127) < 12


def test_garbage_raises_for_the_caller_to_count():
    with pytest.raises(Exception):  # noqa: B017 - PIL's or simplejpeg's own error type
        cpu_ops.decode_train(b"\xff\xd8" + b"\x00" * 500, 32, np.random.default_rng(0))


@pytest.mark.parametrize("seed", [0, 7, -1, 2**63])
def test_batched_sample_streams_equal_the_one_by_one_streams(seed):
    """A batch's crop generators are computed at once with numpy; they must give exactly the numbers each
    sample's own generator gives (a resumed run, and the nvjpeg backend's crops, depend on it), past the
    precomputed draws too."""
    from fastpipe.loaders.rng import SampleRng

    positions = np.array([0, 1, 63, 2**40, 2**62 + 12345])
    for position, batched in zip(positions.tolist(), SampleRng.batch((seed, 3), positions, draws=4)):
        one = SampleRng(seed, 3, position)
        assert [batched.random() for _ in range(9)] == [one.random() for _ in range(9)]
    values = [r.random() for r in SampleRng.batch((seed, 3), np.arange(2000))]
    assert 0 <= min(values) < 0.01 and 0.99 < max(values) < 1 and abs(np.mean(values) - 0.5) < 0.03

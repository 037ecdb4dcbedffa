"""The crop-aware decoder (fastpipe/_jpegcrop.c): the box's pixels are a full decode's, for every JPEG kind; damaged
files raise and the loader skips them as before; without the extension everything decodes as it did; the draws,
and so an epoch, do not change; and a machine without a compiler still installs fastpipe."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from fastpipe import make_loader
from fastpipe.convert.demo import render
from fastpipe.dataset.loading import load
from fastpipe.dataset.shardformat import read_index
from fastpipe.errors import MissingDependency
from fastpipe.loaders import cpu_ops, jpegcrop

ROOT = Path(__file__).resolve().parent.parent
built = pytest.mark.skipif(jpegcrop.ext is None, reason=f"crop decoder not built ({jpegcrop.absent})")


def _pil(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _cv2(im: Image.Image, factor: int) -> bytes:
    """OpenCV writes the sampling factors Pillow does not (4:1:1, 4:4:0), here with restart markers too."""
    ok, enc = cv2.imencode(".jpg", np.asarray(im)[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90,
                                                               cv2.IMWRITE_JPEG_SAMPLING_FACTOR, factor,
                                                               cv2.IMWRITE_JPEG_RST_INTERVAL, 3])
    assert ok
    return enc.tobytes()


KINDS = {
    "4:2:0": lambda im: _pil(im, subsampling="4:2:0"),
    "4:4:4": lambda im: _pil(im, subsampling="4:4:4"),
    "4:2:2": lambda im: _pil(im, subsampling="4:2:2"),
    "gray": lambda im: _pil(im.convert("L")),
    "progressive": lambda im: _pil(im, progressive=True),
    "4:1:1, restarts": lambda im: _cv2(im, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411),
    "4:4:0, restarts": lambda im: _cv2(im, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440),
}


def photo(kind="4:2:0", w=333, h=251, seed=0) -> bytes:
    """A demo photo (shapes, blur, camera grain) at an odd size: every iMCU row and column is partial somewhere."""
    return KINDS[kind](render(("leaf_rust", "pipe_crack")[seed % 2], w, h, seed))


def boxes(w: int, h: int, rng) -> list[tuple[int, int, int, int]]:
    """Random boxes, the edges and corners, and 1-pixel boxes (at iMCU boundaries, and at the far corner)."""
    fixed = [(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, w, h), (0, 0, w, 1), (0, h - 1, w, h), (0, 0, 1, h),
             (w - 1, 0, w, h), (16, 16, 17, 17), (min(32, w - 1), 8, min(33, w), 9), (w // 2, h // 2, w, h)]
    rand = []
    for _ in range(25):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        rand.append((x0, y0, int(rng.integers(x0 + 1, w + 1)), int(rng.integers(y0 + 1, h + 1))))
    return fixed + rand


@built
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("w,h", [(333, 251), (197, 263)])
def test_box_pixels_are_a_full_decodes(kind, w, h):
    """At every DCT scale the crop decoder uses, each box equals the same box of a full decode by the same
    libjpeg-turbo (exactly: the box is widened for the upsampling at its edges), and the full decode equals
    simplejpeg's (the full-decode path's) within 1 grey level. Measured: 0 everywhere."""
    data, rng = photo(kind, w, h, seed=w), np.random.default_rng(w)
    for denom in (1, 2, 4, 8):
        sw, sh = -(-w // denom), -(-h // denom)
        own = jpegcrop.decode_box(data, denom, (0, 0, sw, sh)).copy()
        ref = simplejpeg.decode_jpeg(data, "RGB", min_width=sw, min_height=sh)
        assert own.shape == ref.shape == (sh, sw, 3)
        assert np.abs(own.astype(int) - ref).max() <= 1
        for x0, y0, x1, y1 in boxes(sw, sh, rng):
            box = jpegcrop.decode_box(data, denom, (x0, y0, x1, y1))
            assert box.shape == (y1 - y0, x1 - x0, 3)
            assert np.array_equal(box, own[y0:y1, x0:x1]), (denom, (x0, y0, x1, y1))


# Every sampling a frame header may declare: each component's factors against the largest are 1..4 with at most 10
# blocks a MCU (so no 3x3, 4x3 or 4x4 for a colour file), plus grayscale and chroma factors other than 1x1.
SAMPLINGS = [((h, v), (1, 1), (1, 1)) for h in range(1, 5) for v in range(1, 5) if h * v <= 8] + \
    [((1, 1),), ((1, 1), (2, 2), (1, 1)), ((2, 2), (1, 2), (1, 2)), ((2, 2), (2, 1), (1, 1)), ((3, 2), (1, 2), (1, 2))]


@built
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: ",".join(f"{h}x{v}" for h, v in s))
def test_every_sampling_crops_as_its_full_decode_at_every_scale_the_decoder_uses(sampling):
    """A box the crop decoder gives is the same box of its whole-image decode at that scale, for every sampling;
    where a DCT-scaled crop is not (4x2 and 2x4 before libjpeg-turbo 3.0.0: up to 177 grey levels apart on this
    photo) the decoder does not scale. Whole-image scaled decodes never crop: simplejpeg's (which refuses all but
    the common samplings) and Pillow's draft() equal the crop decoder's, whatever their libjpeg-turbo."""
    from jpegs import encode

    w, h = 333, 251
    data, rng = encode(np.asarray(render("leaf_rust", w, h, 3)), sampling), np.random.default_rng(7)
    assert jpegcrop.header(data)[3] == sampling
    for denom in (1, 2, 4, 8):
        sw, sh = -(-w // denom), -(-h // denom)
        if denom > 1 and not jpegcrop.scaled_crops(sampling):
            assert sampling[0] in ((4, 2), (2, 4)) and not jpegcrop.crops_fixed()
            assert jpegcrop.scale_for(w, h, (0, 0, w, h), w // 8, sampling) == 1
            continue
        own = jpegcrop.decode_box(data, denom, (0, 0, sw, sh)).copy()
        for x0, y0, x1, y1 in boxes(sw, sh, rng):
            assert np.array_equal(jpegcrop.decode_box(data, denom, (x0, y0, x1, y1)), own[y0:y1, x0:x1]), \
                (denom, (x0, y0, x1, y1))
        pil = Image.open(io.BytesIO(data))
        pil.draft("RGB", (w // denom, h // denom))
        assert np.abs(np.asarray(pil.convert("RGB")).astype(int) - own).max() <= 1
        try:
            fast = simplejpeg.decode_jpeg(data, "RGB", min_width=sw, min_height=sh)
        except ValueError:
            assert sampling not in (((1, 1),), *(((h, v), (1, 1), (1, 1)) for h, v in ((1, 1), (2, 1), (2, 2))))
            continue
        assert np.abs(fast.astype(int) - own).max() <= 1


@built
def test_the_loader_path_takes_the_scale_from_the_files_sampling(monkeypatch):
    """cpu_ops asks the crop decoder for a scaled box of a 4:2:0 file and, where this libjpeg-turbo gets its scaled
    crops wrong, for an unscaled one of a 4x2 file with the same box and output."""
    from jpegs import encode

    asked, decode_box = [], jpegcrop.decode_box
    monkeypatch.setattr(jpegcrop, "decode_box", lambda data, denom, box: asked.append(denom) or decode_box(data, denom,
                                                                                                          box))
    rgb = np.asarray(render("leaf_rust", 640, 480, 5))
    for sampling in (((2, 2), (1, 1), (1, 1)), ((4, 2), (1, 1), (1, 1))):
        assert cpu_ops.decode_val(encode(rgb, sampling), 64, decoder="crop").shape == (64, 64, 3)
    assert asked[0] > 1 and asked[1] == (asked[0] if jpegcrop.crops_fixed() else 1)


@built
def test_a_jpeg_of_more_scans_than_the_limit_is_refused_as_it_decodes():
    """The progress monitor stops the decoder at scan MAX_SCANS + 1 (a valid file that repeats its DC scan)."""
    from jpegs import encode

    from fastpipe.dataset.imageguard import MAX_SCANS

    rgb = np.asarray(render("leaf_rust", 64, 48, 0))
    assert jpegcrop.decode_box(encode(rgb, scans=MAX_SCANS), 1, (0, 0, 64, 48)).shape == (48, 64, 3)
    with pytest.raises(jpegcrop.Error, match=f"more than {MAX_SCANS} scans"):
        jpegcrop.decode_box(encode(rgb, scans=MAX_SCANS + 1), 1, (0, 0, 8, 8))


@built
@pytest.mark.parametrize("kind", ["4:2:0", "gray", "progressive"])
def test_train_and_val_outputs_equal_the_full_decode_paths(kind):
    """The same draws and the same resize and flip: where neither path scales the DCT (boxes under twice the
    output), the output is the full-decode path's exactly; where both do, within the resampling of a 1/2 (crop)
    instead of an M/8 (simplejpeg) scaled decode."""
    data = photo(kind)
    for seed in range(12):
        a, b = (cpu_ops.decode_train(data, 160, np.random.default_rng(seed), decoder=d) for d in ("crop", "simplejpeg"))
        assert np.array_equal(a, b)
    assert np.array_equal(*(cpu_ops.decode_val(data, 160, decoder=d) for d in ("crop", "simplejpeg")))
    small = [cpu_ops.decode_val(data, 56, decoder=d).astype(int) for d in ("crop", "simplejpeg")]
    assert np.abs(small[0] - small[1]).mean() < 3  # 1/2 against 5/8 scaled, then INTER_AREA to 56 px


@built
def test_scale_is_a_power_of_two_that_still_covers_the_output():
    assert jpegcrop.scale_for(427, 320, (0, 0, 427, 320), 224) == 1  # box under twice the output
    assert jpegcrop.scale_for(1000, 800, (0, 0, 1000, 800), 224) == 2  # 1/4 would give 200 < 224 rows
    assert jpegcrop.scale_for(4000, 3000, (0, 0, 4000, 3000), 224) == 8
    assert jpegcrop.scale_for(1000, 800, (100, 0, 600, 500), 224) == 2  # 1/2 of a 500 box: 250 >= 224


@built
def test_damaged_files_raise_a_clean_error():
    data = photo()
    truncated = data[: len(data) * 2 // 3]
    with pytest.raises(jpegcrop.Error, match="end-of-image"):  # even a box the truncation does not reach
        jpegcrop.decode_box(truncated, 1, (0, 0, 8, 8))
    body = bytearray(data)
    body[len(body) // 3 : -2] = np.random.default_rng(0).bytes(len(body) - 2 - len(body) // 3)
    with pytest.raises(jpegcrop.Error):  # corrupt entropy-coded data above the box's last row
        jpegcrop.decode_box(bytes(body), 1, (0, 200, 333, 251))
    for bad in (b"", b"\xff\xd8\xff", b"not a jpeg at all", data[:100]):
        with pytest.raises(jpegcrop.Error):
            jpegcrop.header(bad)
    with pytest.raises(jpegcrop.Error, match="outside"):
        jpegcrop.decode_box(data, 1, (0, 0, 334, 10))
    with pytest.raises(ValueError, match="denom"):
        jpegcrop.ext.decode(data, 3, 0, 0, 1, 1, np.empty(100, np.uint8), 500)
    with pytest.raises(jpegcrop.Error, match="too small"):
        jpegcrop.ext.decode(data, 1, 0, 0, 10, 10, np.empty(100, np.uint8), 500)


def _cmyk() -> bytes:
    buf = io.BytesIO()
    Image.new("CMYK", (120, 90), (10, 200, 30, 0)).save(buf, "JPEG")
    return buf.getvalue()


@built
def test_a_chunk_of_training_samples_is_the_python_paths_bit_for_bit():
    """train_chunk (the loader's training path with the crop decoder: draws, box decode, OpenCV's INTER_LINEAR
    resize and the flip in C, without the GIL) against cpu_ops.decode_train with the same generator: every JPEG
    kind, from thumbnails to camera size, DCT-scaled and not. What it does not take (not a JPEG, cut short, corrupt,
    CMYK, over max_pixels, a box INTER_AREA shrinks) comes back for the Python path, its slot untouched."""
    from fastpipe.loaders.rng import SampleRng

    rng = np.random.default_rng(0)
    good = [photo(list(KINDS)[i % len(KINDS)], *map(int, rng.integers(24, 1400, 2)), seed=i) for i in range(42)]
    corrupt = bytearray(good[1])
    corrupt[len(corrupt) // 3 : -2] = rng.bytes(len(corrupt) - 2 - len(corrupt) // 3)
    bad = [b"", b"not a jpeg at all", good[0][: len(good[0]) // 2], bytes(corrupt), _cmyk()]
    images = good + bad
    taken = set()
    for size, min_scale in ((224, 0.08), (64, 0.5), (161, 1.0), (24, 0.08)):
        at = np.arange(len(images)) * 7
        states = SampleRng.states((size, 3), at)  # what the C path derives from the key and the positions
        out = np.full((len(images), size, size, 3), 7, np.uint8)
        key = SampleRng.key_state((size, 3))
        status = np.frombuffer(jpegcrop.train_chunk(images, key, at, size, min_scale, out, 10**9), np.uint8)
        assert status.tolist()[-len(bad):] == [1] * len(bad)
        for i, data in enumerate(images[: len(good)]):
            if status[i] == 0:
                taken.add(i)
                want = cpu_ops.decode_train(data, size, SampleRng.at(states[i]), min_scale, decoder="crop")
                assert np.array_equal(out[i], want), (size, i)
            else:
                assert (out[i] == 7).all()  # the Python path decides: an INTER_AREA shrink, here
        assert sum(status[: len(good)] == 0) > 0
    assert len(taken) == len(good)  # every good file taken at some size
    small = np.zeros((1, 32, 32, 3), np.uint8)
    assert list(jpegcrop.train_chunk(good[:1], SampleRng.key_state((0, 0)), np.arange(1), 32, 0.08, small, 10)) == [1]
    with pytest.raises(ValueError, match="lengths"):
        jpegcrop.train_chunk(good[:2], SampleRng.key_state((0, 0)), np.arange(1), 32, 0.08, small, 10**9)
    with pytest.raises(TypeError, match="int64"):  # never another type's bytes read as positions
        jpegcrop.train_chunk(good[:1], SampleRng.key_state((0, 0)), np.arange(1.0), 32, 0.08, small, 10**9)


@built
def test_a_batchs_chunks_write_their_own_rows_only():
    """Worker threads decode a batch in chunks (lo..hi of its samples, into its buffer): the chunks together give
    the whole batch's call, bit for bit, and a chunk leaves the other rows alone; a range outside the batch is
    refused."""
    from fastpipe.loaders.rng import SampleRng

    images = [photo(list(KINDS)[i % len(KINDS)], 200 + 13 * i, 150 + 7 * i, seed=i) for i in range(11)]
    key, at = SampleRng.key_state((4, 1)), np.arange(100, 111)
    whole = np.zeros((11, 48, 48, 3), np.uint8)
    assert not any(jpegcrop.train_chunk(images, key, at, 48, 0.08, whole, 10**9))
    parts = np.full_like(whole, 7)
    assert jpegcrop.train_chunk(images, key, at, 48, 0.08, parts, 10**9, 3, 8) == bytes(5)
    assert (parts[:3] == 7).all() and (parts[8:] == 7).all() and np.array_equal(parts[3:8], whole[3:8])
    for lo, hi in ((0, 3), (8, 11), (11, 11)):
        assert len(jpegcrop.train_chunk(images, key, at, 48, 0.08, parts, 10**9, lo, hi)) == hi - lo
    assert np.array_equal(parts, whole)
    for lo, hi in ((-1, 2), (5, 4), (0, 12)):
        with pytest.raises(ValueError, match=r"lo\.\.hi"):
            jpegcrop.train_chunk(images, key, at, 48, 0.08, parts, 10**9, lo, hi)


@built
def test_a_chunk_slices_each_sample_from_its_shards_view_and_hands_back_what_lies_outside():
    """The loader passes the shards' memory maps and each sample's (shard, start, end): a sample whose bytes are not
    inside its shard's view (a shard cut short, an unmapped shard, a shard number out of range) is handed back to
    the Python path, its row untouched, never read past a view's end; spans of another type are refused."""
    from fastpipe.loaders.rng import SampleRng

    images = [photo(list(KINDS)[i % len(KINDS)], 180 + 11 * i, 140 + 5 * i, seed=i) for i in range(6)]
    shard = b"".join(images)
    ends = np.cumsum([len(im) for im in images])
    views = [memoryview(shard), None, memoryview(shard)[: int(ends[3]) - 1]]  # the last: cut short in sample 3
    spans = np.array([(0, e - len(im), e) for im, e in zip(images, ends)], np.int64)
    spans[1, 0], spans[2, 0], spans[3, 0], spans[4, 0], spans[5, 0] = 2, 1, 2, 7, -1
    key, at = SampleRng.key_state((2, 2)), np.arange(6)
    want = np.zeros((6, 40, 40, 3), np.uint8)
    assert not any(jpegcrop.train_chunk(images, key, at, 40, 0.08, want, 10**9))
    out, status = np.full_like(want, 7), bytearray(b"\x01") * 6
    decode = jpegcrop.chunk_decoder(40, 0.08, 10**9)
    assert decode(views, spans, key, at, out, status, 0, 6) == 4
    assert list(status) == [0, 0, 1, 1, 1, 1]  # in its view; in the cut view, whole; unmapped; cut; out of range
    assert np.array_equal(out[:2], want[:2]) and (out[2:] == 7).all()
    with pytest.raises(TypeError, match="int64"):
        decode(views, spans.astype(np.int32), key, at, out, status, 0, 6)


@built
def test_the_extension_counts_the_time_it_runs_without_the_gil():
    """profile_worker.py --gil subtracts it: it grows by about a decode's time with each decode, in wall and CPU."""
    from fastpipe.loaders.rng import SampleRng

    images = [photo("4:2:0", 1200, 900, seed=i) for i in range(4)]
    wall, cpu = jpegcrop.ext.released()
    start = time.perf_counter()
    jpegcrop.train_chunk(images, SampleRng.key_state((0, 0)), np.arange(4), 64, 0.08,
                         np.zeros((4, 64, 64, 3), np.uint8), 10**9)
    took = time.perf_counter() - start
    wall2, cpu2 = jpegcrop.ext.released()
    assert 0 < wall2 - wall <= took and cpu2 - cpu > 0


@built
def test_the_c_path_is_used_only_where_it_gives_the_python_paths_pixels(monkeypatch):
    """Its resize reproduces this OpenCV's INTER_LINEAR: where a check photo's pixels differ (another OpenCV build),
    every sample takes the Python path."""
    assert cpu_ops.chunk_matches()
    real = cpu_ops.decode_train
    monkeypatch.setattr(cpu_ops, "decode_train", lambda *a, **k: real(*a, **k) // 2)
    cpu_ops.chunk_matches.cache_clear()
    try:
        assert not cpu_ops.chunk_matches()
    finally:
        monkeypatch.undo()
        cpu_ops.chunk_matches.cache_clear()
    assert cpu_ops.chunk_matches()


@built
def test_a_data_sets_limit_of_more_pixels_than_a_c_long_holds_still_trains(converted, tmp_path):
    import json

    out = tmp_path / "set"
    shutil.copytree(converted, out)
    manifest = json.loads((out / "dataset.json").read_text())
    manifest["settings"]["max_pixels"] = 10**20  # someone's "no limit"
    (out / "dataset.json").write_text(json.dumps(manifest))
    loader = make_loader(out, "torch", batch_size=8, image_size=32, device="cpu", num_workers=0)
    assert sum(len(y) for _, y in loader) == loader.batches * 8


@built
def test_a_chunk_never_writes_wrong_pixels_from_damaged_bytes():
    """Random damage anywhere in a file: the chunk decodes it as the Python path does, or hands it back."""
    from fastpipe.loaders.rng import SampleRng

    rng = np.random.default_rng(1)
    base = [photo(kind, 301, 227, seed=i) for i, kind in enumerate(KINDS)]
    damaged = []
    for i in range(70):
        data = bytearray(base[i % len(base)])
        for _ in range(int(rng.integers(1, 6))):
            at = int(rng.integers(2, len(data) - 2))
            data[at : at + int(rng.integers(1, 9))] = rng.bytes(min(8, len(data) - 2 - at))[: len(data) - 2 - at]
        damaged.append(bytes(data[: len(base[i % len(base)])]))
    states = SampleRng.states((5, 0), np.arange(len(damaged)))
    out = np.zeros((len(damaged), 48, 48, 3), np.uint8)
    key, at = SampleRng.key_state((5, 0)), np.arange(len(damaged))
    status = np.frombuffer(jpegcrop.train_chunk(damaged, key, at, 48, 0.08, out, 10**9), np.uint8)
    for i in np.flatnonzero(status == 0).tolist():
        want = cpu_ops.decode_train(damaged[i], 48, SampleRng.at(states[i]), decoder="crop")
        assert np.array_equal(out[i], want)
    assert (status == 1).any()


@built
def test_absurd_dimensions_are_refused_before_allocating():
    data = bytearray(photo(w=64, h=48))
    sof = data.index(b"\xff\xc0")  # baseline frame header: length (2), precision (1), height (2), width (2)
    data[sof + 5 : sof + 9] = (30000).to_bytes(2, "big") + (30000).to_bytes(2, "big")
    assert jpegcrop.header(bytes(data))[:2] == (30000, 30000)
    with pytest.raises(jpegcrop.Error, match="limit"):
        jpegcrop.decode_box(bytes(data), 1, (0, 0, 16, 16))


@built
def test_a_damaged_sample_is_skipped_and_counted_as_before(converted, tmp_path):
    """Header intact, the rest zeros: the crop decoder refuses it, so do the full-decode paths; skipped, named."""
    out = tmp_path / "bad"
    shutil.copytree(converted, out)
    s = load(out).splits["train"].shards[0]
    key, parts = read_index(out / s.index)[0]
    off, size = parts["jpg"]
    data = bytearray((out / s.path).read_bytes())
    data[off + size // 2 : off + size] = bytes(size - size // 2)
    (out / s.path).write_bytes(bytes(data))
    loader = make_loader(out, "torch", batch_size=8, image_size=48, device="cpu", num_workers=0)
    with pytest.warns(UserWarning, match=f"skipping sample {key} in shard"):
        assert all(len(y) == 8 for _, y in loader)
    assert loader.stats.skipped == 1


def test_without_the_extension_everything_decodes_as_before(monkeypatch):
    data = photo()
    want = [cpu_ops.decode_train(data, 96, np.random.default_rng(s), decoder="simplejpeg") for s in range(6)]
    monkeypatch.setattr(jpegcrop, "ext", None)
    monkeypatch.setattr(jpegcrop, "absent", "extension not built: No module named 'fastpipe._jpegcrop'")
    got = [cpu_ops.decode_train(data, 96, np.random.default_rng(s)) for s in range(6)]
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    assert "full decode" in cpu_ops.active() and "not built" in cpu_ops.active()
    with pytest.raises(MissingDependency, match=r"not built.*libjpeg62-turbo-dev"):
        cpu_ops.decode_val(data, 96, decoder="crop")
    from fastpipe.doctor import check_decoder

    assert check_decoder().status == "WARN" and "pip install -e ." in check_decoder().fix


def test_crop_decoder_setting_is_refused_when_absent(converted, monkeypatch):
    monkeypatch.setattr(jpegcrop, "ext", None)
    with pytest.raises(MissingDependency, match="cpu_decoder='crop'"):
        make_loader(converted, "torch", cpu_decoder="crop", device="cpu")


@built
@pytest.mark.parametrize("backend", ["torch", "nvjpeg"])
def test_an_epoch_is_what_the_full_decode_path_gives(converted, backend, monkeypatch):
    """Same samples, labels and order, and (no DCT scaling at these sizes) the same pixels as with the extension
    absent; the CPU fallback of the nvjpeg backend too, from the boxes its workers drew."""
    kw = dict(batch_size=8, image_size=48, device="cpu", num_workers=0, normalize=False, with_keys=True, seed=3)

    def epoch(e):
        loader = make_loader(converted, backend, **kw)
        loader.set_epoch(e)
        keys, labels, images = zip(*[(k, y, x) for x, y, k in loader])
        return keys, torch.cat(labels), torch.cat(images), loader.describe()["decoder"]

    chunks = []
    real = jpegcrop.ext.train_chunk
    monkeypatch.setattr(jpegcrop.ext, "train_chunk", lambda *a: chunks.append(a[-1] - a[-2]) or real(*a))  # hi - lo
    crop = epoch(1)
    assert "crop-aware" in crop[3]
    assert (sum(chunks) == sum(map(len, crop[0]))) == (backend == "torch")  # the torch backend's samples, in chunks
    assert all(torch.equal(a, b) for a, b in zip(crop[1:3], epoch(1)[1:3]))  # deterministic
    monkeypatch.setattr(jpegcrop, "ext", None)
    full = epoch(1)
    assert crop[0] == full[0] and torch.equal(crop[1], full[1])
    if backend == "torch":
        assert torch.equal(crop[2], full[2])
    else:  # the fallback decodes on the CPU with torch's antialiased bilinear instead of OpenCV
        assert (crop[2].float() - full[2].float()).abs().mean() < 2


def _build(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})


def test_install_without_a_compiler_goes_on_without_the_extension(tmp_path):
    done = _build(tmp_path, {"CC": "false", "LDSHARED": "false"})
    assert done.returncode == 0, done.stderr
    assert "crop-aware JPEG decoder was not built" in done.stdout + done.stderr
    assert not list((tmp_path / "lib").rglob("_jpegcrop*"))


def _can_compile() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and Path("/usr/include/jpeglib.h").exists()


@pytest.mark.skipif(not _can_compile(), reason="no C compiler or libjpeg headers")
def test_the_extension_builds_and_loads(tmp_path):
    done = _build(tmp_path, {})
    assert done.returncode == 0, done.stderr
    (so,) = (tmp_path / "lib").rglob("_jpegcrop*.so")
    probe = "import importlib.util as u, sys; s = u.spec_from_file_location('fastpipe._jpegcrop', sys.argv[1]); " \
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.LIBJPEG_TURBO_VERSION)"
    loaded = subprocess.run([sys.executable, "-c", probe, str(so)], capture_output=True, text=True)
    assert loaded.returncode == 0 and loaded.stdout.strip()[0].isdigit(), loaded.stderr


@built
def test_doctor_names_the_libjpeg_turbo_each_decoder_runs_with():
    """The crop decoder's is read from the library it loaded (the one it was built against, here), simplejpeg's from
    its module, Pillow's as Pillow says; an affected crop decoder says which files it crops unscaled."""
    import re

    from PIL import features

    from fastpipe.doctor import turbo_versions

    line = turbo_versions()
    assert jpegcrop.runtime_version() == jpegcrop.ext.LIBJPEG_TURBO_VERSION
    assert f"crop decoder {jpegcrop.runtime_version()}" in line and re.search(r"simplejpeg \d+\.\d+\.\d+", line)
    assert f"Pillow {features.version_feature('libjpeg_turbo')}" in line
    assert ("4x2 and 2x4" in line) == (not jpegcrop.crops_fixed())

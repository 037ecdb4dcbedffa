"""The header checks every decoder's input passes first (fastpipe/dataset/imageguard.py), and each decoder path refusing
what they refuse: a JPEG of more scans than libjpeg-turbo's limit, more pixels than the data set's limit."""

from __future__ import annotations

import io

import numpy as np
import pytest
from jpegs import encode
from PIL import Image

from fastpipe.convert.demo import render
from fastpipe.convert.images import ImageSettings, Rejected, process
from fastpipe.dataset import imageguard
from fastpipe.dataset.imageguard import MAX_SCANS
from fastpipe.loaders import cpu_ops, jpegcrop

RGB = np.asarray(render("pipe_crack", 96, 72, 2))


def _pil(im: Image.Image, fmt="JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def test_the_marker_walk_reads_frame_and_scans_of_real_files():
    """Pillow's progressive files have libjpeg's 10 scans; a baseline file one; an EXIF thumbnail (a JPEG inside an
    APP1 segment) is not counted; a view of a shard's memory map reads as bytes do."""
    im = Image.fromarray(RGB)
    progressive = imageguard.jpeg_info(_pil(im, progressive=True, subsampling="4:2:0"))
    assert (progressive.width, progressive.height, progressive.scans, progressive.progressive) == (96, 72, 10, True)
    assert progressive.sampling == ((2, 2), (1, 1), (1, 1))
    exif = Image.Exif()
    exif[0x0112] = 1
    with_thumb = _pil(im, exif=exif.tobytes(), subsampling="4:4:4")
    thumb = _pil(im.resize((24, 18)), progressive=True)
    spliced = with_thumb[:2] + b"\xff\xe1" + (len(thumb) + 8).to_bytes(2, "big") + b"Thumb\0" + thumb + with_thumb[2:]
    info = imageguard.jpeg_info(memoryview(bytearray(spliced)))
    assert (info.width, info.scans, info.sampling) == (96, 1, ((1, 1), (1, 1), (1, 1)))
    assert imageguard.jpeg_info(_pil(im, "PNG")) is None and imageguard.jpeg_info(b"\xff\xd8") is None


def test_scans_are_counted_up_to_the_limit_and_refused_past_it():
    assert imageguard.jpeg_info(encode(RGB, scans=MAX_SCANS)).scans == MAX_SCANS
    with pytest.raises(imageguard.TooManyScans, match=f"more than {MAX_SCANS} scans"):
        imageguard.check(encode(RGB, scans=MAX_SCANS + 1))


def test_pixels_are_refused_from_the_header_before_anything_is_allocated():
    """A 2 KB JPEG whose frame says 60000 x 60000; a PNG over Pillow's own bomb limit is ours to refuse too."""
    bomb = encode(RGB[:16, :16], size=(60000, 60000))
    assert len(bomb) < 4096
    with pytest.raises(imageguard.TooLarge, match="60000x60000 = 3600000000 pixels, more than the limit"):
        imageguard.check(bomb)
    assert imageguard.check(_pil(Image.fromarray(RGB), "PNG"), 96 * 72) == (96, 72)
    with pytest.raises(imageguard.TooLarge):
        imageguard.check(_pil(Image.fromarray(RGB), "PNG"), 96 * 72 - 1)
    with pytest.raises(imageguard.TooLarge):
        imageguard.check(_pil(Image.new("1", (15000, 15000)), "PNG"))  # 225 Mpx: over Pillow's limit and ours
    assert imageguard.check(b"not an image") is None


@pytest.mark.parametrize("decoder", ["auto", "crop", "simplejpeg", "pillow"])
def test_no_loader_decoder_is_given_what_the_header_checks_refuse(decoder):
    """Each decoder the loader workers run (and the nvjpeg backend's header read) refuses a JPEG of too many scans
    and one over the data set's pixel limit; the loader skips and counts such a sample as any undecodable one."""
    if decoder == "crop" and jpegcrop.ext is None:
        pytest.skip("crop decoder not built")
    scans = encode(RGB, scans=MAX_SCANS + 1)
    with pytest.raises((imageguard.TooManyScans, jpegcrop.Error), match=f"more than {MAX_SCANS} scans"):
        cpu_ops.decode_val(scans, 32, decoder=decoder)
    plain = encode(RGB)
    assert cpu_ops.decode_val(plain, 32, decoder=decoder, max_pixels=96 * 72).shape == (32, 32, 3)
    with pytest.raises(imageguard.TooLarge):
        cpu_ops.decode_train(plain, 32, np.random.default_rng(0), decoder=decoder, max_pixels=96 * 72 - 1)
    with pytest.raises(imageguard.Refused):
        cpu_ops.jpeg_size(scans)


def test_the_converter_rejects_a_jpeg_of_too_many_scans_as_corrupt():
    res = process(encode(RGB, scans=MAX_SCANS + 1), ImageSettings(short_side=32))
    assert isinstance(res, Rejected) and res.reason == "corrupt" and f"more than {MAX_SCANS} scans" in res.detail
    assert not isinstance(process(encode(RGB, scans=MAX_SCANS), ImageSettings(short_side=32)), Rejected)


def test_foreign_shards_holding_hostile_images_index_and_load_with_them_skipped(tmp_path, capsys):
    """Shards another tool wrote, holding a 2 KB JPEG whose header says 60000 x 60000, a JPEG of too many scans and
    one over --max-pixels: `fastpipe index` reads no traceback (Pillow's DecompressionBombError), leaves them out of
    mean/std and the previews, names and counts them, and records its pixel limit; the loader then refuses each
    from its header before any decoder touches it, and skips and counts it."""
    import webdataset as wds
    from conftest import COLORS, photo

    from fastpipe import make_loader
    from fastpipe.cli import main
    from fastpipe.dataset.loading import load

    out = tmp_path / "foreign"
    out.mkdir()
    hostile = {3: encode(RGB[:16, :16], size=(60000, 60000)), 5: encode(RGB, scans=MAX_SCANS + 1),
               7: encode(np.asarray(render("leaf_rust", 160, 120, 1)))}  # 19,200 pixels: over --max-pixels 10000
    with wds.ShardWriter(str(out / "part-%03d.tar"), maxcount=9) as sink:
        for i in range(18):
            image = hostile.get(i % 9) or photo(list(COLORS.values())[i % 3], seed=i)
            sink.write({"__key__": f"s{i:04d}", "jpg": image, "cls": str(i % 3).encode()})
    train, val = sorted(out.glob("part-*.tar"))
    assert main(["index", str(train), "--val", str(val), "--max-pixels", "10000"]) == 0
    said = capsys.readouterr().out
    assert "3 of the images sampled for mean/std refused or failed to decode" in said and "s0003" in said
    m = load(out)
    assert m.settings["max_pixels"] == 10000 and m.settings["stats_from_samples"] == 6
    assert [u.split(":")[0] for u in m.settings["undecoded"]] == ["part-000.tar/s0003", "part-000.tar/s0005",
                                                                  "part-000.tar/s0007"]
    assert len(list((out / "previews").glob("*.jpg"))) == 3
    loader = make_loader(out, "torch", split="val", batch_size=4, image_size=32, device="cpu", num_workers=0)
    with pytest.warns(UserWarning, match="skipping sample s001[246]"):
        assert sum(len(y) for _, y in loader) == 6
    assert loader.stats.skipped == 3
    why = " ".join(loader.stats.skipped_keys)
    assert "60000x60000" in why and f"more than {MAX_SCANS} scans" in why and "more than the limit of 10000" in why

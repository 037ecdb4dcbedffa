"""The shard format layer: `.idx` damage and hostile foreign tars are refused at index time, naming the shard and
member, never surfacing later as a worker traceback or a MemoryError."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from conftest import COLORS, photo

from fastpipe.convert.foreign import IndexConfig, index_only, index_shards
from fastpipe.dataset.shardformat import decode_label, index_tar, member_chunk, read_index, tar_header
from fastpipe.errors import DataError


def tar(path: Path, members: list[tuple[str, bytes]], links: dict[str, tuple[str, bytes]] | None = None) -> Path:
    """A tar of regular members, plus symlink/hardlink members ({name: (type, target)})."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
            info.linkname = target.decode()
            tf.addfile(info)
    return path


def samples(n: int, image="jpg", label=lambda i: str(i % 2).encode()) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        out += [(f"s{i:03d}.{image}", photo(COLORS["red"], seed=i, fmt="PNG" if image == "png" else "JPEG")),
                (f"s{i:03d}.cls", label(i))]
    return out


def refused(path: Path, match: str) -> None:
    with pytest.raises(DataError, match=match):
        index_shards(IndexConfig([path]))


def test_symlink_and_hardlink_members_are_refused(tmp_path):
    refused(tar(tmp_path / "a.tar", samples(2), {"s009.jpg": ("sym", b"/etc/passwd")}), r"a\.tar.*s009\.jpg.*symlink")
    refused(tar(tmp_path / "b.tar", samples(2), {"s009.jpg": ("hard", b"s000.jpg")}), r"b\.tar.*hard link")


def test_garbage_and_truncated_tars_are_refused(tmp_path):
    (tmp_path / "g.tar").write_bytes(b"this is not a tar file" * 100)
    refused(tmp_path / "g.tar", r"g\.tar.*not a readable tar")
    whole = tar(tmp_path / "t.tar", samples(3)).read_bytes()
    (tmp_path / "t.tar").write_bytes(whole[:1500])  # cut inside the first image
    refused(tmp_path / "t.tar", r"t\.tar.*beyond the end")


def test_a_member_claiming_a_huge_size_is_refused_without_reading_it(tmp_path):
    data = bytearray(tar(tmp_path / "h.tar", samples(2)).read_bytes())
    info = tarfile.TarInfo("s000.jpg")
    info.size = 5 * 10**9  # 5 GB, in a file of a few KB
    data[:512] = info.tobuf(format=tarfile.USTAR_FORMAT)
    (tmp_path / "h.tar").write_bytes(bytes(data))
    refused(tmp_path / "h.tar", r"h\.tar.*s000\.jpg.*beyond the end")


def test_duplicate_keys_are_refused(tmp_path):
    members = [*samples(2), ("s000.jpg", photo(COLORS["red"], seed=50)), ("s000.cls", b"1")]
    refused(tar(tmp_path / "d.tar", members), r"d\.tar.*s000")


@pytest.mark.parametrize("label,match", [(b"-1", "label -1"), (b"99999999", "label 99999999"),
                                         (b"\xff\xfe", "not an integer"), (b"7" * 500, "not a class index")])
def test_bad_labels_are_refused_with_the_member(tmp_path, label, match):
    refused(tar(tmp_path / "l.tar", [*samples(2), ("s005.jpg", photo(COLORS["red"])), ("s005.cls", label)]),
            rf"l\.tar.*s005\.cls.*{match}")


def test_mixed_image_types_are_refused(tmp_path):
    members = [*samples(2), ("s009.png", photo(COLORS["red"], fmt="PNG")), ("s009.cls", b"0")]
    refused(tar(tmp_path / "m.tar", members), r"mix image types.*jpg.*png")


def test_a_sample_without_image_or_label_is_refused(tmp_path):
    refused(tar(tmp_path / "n.tar", [*samples(2), ("s009.cls", b"0")]), r"n\.tar.*s009.*0 image members")
    refused(tar(tmp_path / "o.tar", [*samples(2), ("s009.jpg", photo(COLORS["red"]))]), r"o\.tar.*s009.*no label")


def test_labels_beyond_the_class_list_are_refused(tmp_path):
    names = tmp_path / "classes.txt"
    names.write_text("a\n")
    with pytest.raises(DataError, match=r"s001\.cls holds label 1, outside 0\.\.0"):
        index_shards(IndexConfig([tar(tmp_path / "c.tar", samples(2))], classes_file=str(names)))


def _twice(t: str) -> str:
    lines = t.splitlines()
    return "\n".join([f"v1.2 {len(lines)}", *lines[1:], lines[1]]) + "\n"


@pytest.mark.parametrize("damage,match", [
    (lambda t: "v1.1 2\n" + t.split("\n", 1)[1], "line 1: expected 'v1.2"),
    (lambda t: t.replace("jpg 512 ", "jpg 9999872 ", 1), "line 2: member 's000.jpg' at byte 9999872"),
    (lambda t: t.rstrip("\n").rsplit("\n", 1)[0] + "\n", "line 1: expected 'v1.2 <samples>' for 1 sample"),
    (lambda t: t.replace(" s000.cls", " s000.cls x", 1), "line 2: expected groups of"),
    (lambda t: t.replace("jpg 512", "jpg 5x2", 1), "line 2: offset/size"),
    (_twice, "line 4: key 's000' appears twice"),
])
def test_a_damaged_index_names_file_and_line(tmp_path, damage, match):
    t = tar(tmp_path / "x.tar", samples(2))
    index_only([t])
    idx = tmp_path / "x.idx"
    assert len(read_index(idx, t.stat().st_size)) == 2
    idx.write_text(damage(idx.read_text()))
    with pytest.raises(DataError, match=rf"x\.idx, {match}.*index --idx-only"):
        read_index(idx, t.stat().st_size)


def test_index_lines_round_trip(tmp_path):
    t = tar(tmp_path / "r.tar", samples(3))
    entries = index_tar(t)
    index_only([t])
    assert read_index(tmp_path / "r.idx", t.stat().st_size) == entries
    assert decode_label(b" 3\n", "cls") == 3 and decode_label((5).to_bytes(4, "little"), "lbl") == 5


@pytest.mark.parametrize("name", ["00000001.jpg", "00000001.cls", "k.json", "a" * 96 + ".jpg", "dossier/é.jpg",
                                  "b" * 90 + "/" + "c" * 40 + ".jpg", "ünïcode-" * 20 + ".png"])
@pytest.mark.parametrize("size", [0, 1, 511, 512, 15_000, 8**11 - 1, 8**11])
def test_tar_headers_are_the_bytes_tarfile_writes_and_read_back(name, size):
    """Headers are built by hand (the converter writes 3-4 an image): the same bytes as tarfile's USTAR header,
    names over 100 bytes included (split into prefix and name), and tarfile reads them back; what USTAR cannot
    hold (a name that does not split, 8 GiB) is refused the same way."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    try:
        expected = info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8")
    except ValueError:
        with pytest.raises(ValueError):
            tar_header(name, size)
        return
    head = tar_header(name, size)
    assert head == expected
    back = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    assert (back.name, back.size, back.mode, back.mtime, back.isreg()) == (name, size, 0o444, 0, True)


def test_a_shard_of_hand_built_members_reads_with_tarfile(tmp_path):
    parts = [(f"{i:08d}.{ext}", bytes([i]) * (100 * i + 3)) for i in range(5) for ext in ("jpg", "cls")]
    path = tmp_path / "x.tar"
    path.write_bytes(b"".join(member_chunk(n, d) for n, d in parts) + b"\0" * 1024)
    with tarfile.open(path) as tf:
        assert [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()] == parts


def test_tar_headers_are_recognised_in_every_format_tarfile_writes():
    """The check that a fetched range is the shard its index describes: the header before each image, in the
    formats of shards fastpipe adopts (USTAR, GNU, PAX, fastpipe's own); a wrong size, a block off by one, or
    image bytes are not headers."""
    import numpy as np

    from fastpipe.dataset.shardformat import headers_match

    blocks, sizes = [], []
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        for size in (0, 7, 15_000, 8**11 - 1):
            info = tarfile.TarInfo("dossier/00000001.jpg")
            info.size, info.uname, info.mode = size, "ü" if fmt == tarfile.PAX_FORMAT else "u", 0o644
            blocks.append(info.tobuf(format=fmt)[-512:])  # the member's own header, after any PAX/GNU extension
            sizes.append(size)
    blocks.append(tar_header("00000002.jpg", 123))
    sizes.append(123)
    arr = np.frombuffer(b"".join(blocks), np.uint8).reshape(-1, 512)
    assert headers_match(arr, np.array(sizes)).all()
    assert not headers_match(arr, np.array(sizes) + 1).any()
    jpeg = photo(COLORS["red"])[:512]
    others = np.frombuffer(bytes(512) + jpeg + b"\xff" * 512, np.uint8).reshape(-1, 512)
    assert not headers_match(others, np.array([0, 0, 0])).any()

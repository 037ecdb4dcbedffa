"""Discovery of the files to convert: hostile trees and lists end as items or recorded rejections, never a hang,
a crash or silent loss."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from conftest import COLORS, make_folder, photo

from fastpipe.convert.discovery import discover
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.convert.sources import class_order
from fastpipe.dataset.loading import load
from fastpipe.errors import DataError


def cfg(src, out, **kw) -> ShardConfig:
    return ShardConfig(Path(src), Path(out), **{"short_side": 32, "workers": 0, "val_fraction": 0, **kw})


def reasons(out: Path) -> dict[str, str]:
    return {json.loads(x)["path"]: json.loads(x)["reason"] for x in (out / "rejected.jsonl").read_text().splitlines()}


def test_symlink_loops_are_never_followed(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 3, "green": 3})
    os.symlink(src / "red", src / "red" / "again")  # a loop
    os.symlink(src, src / "green" / "root")  # a loop back to SRC itself
    os.symlink(src / "green", src / "green" / "g1")
    os.symlink(src / "green", src / "red" / "g2")
    summary = shard(cfg(src, tmp_path / "out"))
    assert summary.written == {"train": 6, "val": 0}
    assert load(tmp_path / "out").splits["train"].class_counts == (3, 3)  # no class emptied
    got = reasons(tmp_path / "out")
    assert set(got.values()) == {"symlink-loop"} and "red/again" in got and "green/root" in got


def test_fifo_devices_and_sockets_are_rejected_not_read(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 3, "green": 3})
    os.mkfifo(src / "red" / "pipe.jpg")  # reading it would block forever
    os.symlink("/dev/zero", src / "green" / "zero.jpg")  # reading it would never end
    done = threading.Event()
    t = threading.Thread(target=lambda: (shard(cfg(src, tmp_path / "out")), done.set()), daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "the conversion hung on a FIFO or a device"
    assert reasons(tmp_path / "out") == {"red/pipe.jpg": "not-a-file", "green/zero.jpg": "not-a-file"}


def test_oversized_files_are_bounded(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 3, "green": 3})
    (src / "red" / "big.jpg").write_bytes(photo(COLORS["red"], (200, 200)) + b"\0" * 300_000)
    shard(cfg(src, tmp_path / "out", max_file_size=200_000))
    assert reasons(tmp_path / "out") == {"red/big.jpg": "too-large"}


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_a_file_longer_than_its_stat_size_is_read_whole_and_still_bounded():
    """read_regular asks for the size fstat gives, plus a byte: a file that grew since (here a /proc file, whose
    size reads 0) is read to its end, and the limit still holds."""
    from fastpipe.util import FileTooLarge, read_regular

    proc = Path("/proc/self/cmdline")
    assert proc.stat().st_size == 0
    data = read_regular(proc, 1 << 20)
    assert len(data) > 10 and data == proc.read_bytes()
    with pytest.raises(FileTooLarge):
        read_regular(proc, 5)


def test_nothing_found_is_dropped_silently(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 3, "green": 3})
    make_folder(src / "__init__", {"blue": 2})  # a class folder that happens to start with '__'
    (src / "loose.jpg").write_bytes(photo(COLORS["red"], seed=5))  # not in a class folder
    (src / "__MACOSX").mkdir()
    (src / "__MACOSX" / "._x.jpg").write_bytes(b"junk")  # system clutter: ignored, and counted
    (src / "red" / ".DS_Store").write_bytes(b"junk")
    bad = os.fsencode(src / "green") + b"/caf\xe9.jpg"  # a Latin-1 name: not valid UTF-8
    with open(bad, "wb") as f:
        f.write(photo(COLORS["green"], seed=9))
    summary = shard(cfg(src, tmp_path / "out"))
    m = load(tmp_path / "out")
    assert m.classes == ("__init__", "green", "red") and summary.written["train"] == 8
    got = reasons(tmp_path / "out")
    assert got == {"loose.jpg": "no-class", "green/caf\\xe9.jpg": "bad-name"}
    assert summary.ignored == 2 and "2 hidden/system files ignored" in summary.lines()[0]
    assert summary.discovered == 8 + 2


def test_a_folder_beside_train_and_val_is_recorded(tmp_path):
    make_folder(tmp_path / "src" / "train", {"red": 3, "blue": 3})
    make_folder(tmp_path / "src" / "val", {"red": 1, "blue": 1}, seed=3)
    make_folder(tmp_path / "src" / "test", {"red": 2}, seed=4)
    summary = shard(cfg(tmp_path / "src", tmp_path / "out"))
    assert summary.written == {"train": 6, "val": 2}
    assert reasons(tmp_path / "out") == {"test/red/img_000.jpg": "other-split", "test/red/img_001.jpg": "other-split"}


def test_out_inside_src_is_not_input(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 3, "green": 3})
    out = src / "shards"
    shard(cfg(src, out))
    assert shard(cfg(src, out)).up_to_date  # a rerun sees the same input, not its own output
    shard(cfg(src, out, quality=70, overwrite=True))
    assert load(out).classes == ("green", "red")  # no phantom 'shards' class


def test_integer_labels_keep_numeric_order(tmp_path):
    rows = ["path,label"]
    for label in range(12):
        name = f"img_{label}.jpg"
        (tmp_path / name).write_bytes(photo(COLORS["red"], seed=label))
        rows.append(f"{name},{label}")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    shard(cfg(tmp_path / "list.csv", tmp_path / "out"))
    m = load(tmp_path / "out")
    assert m.classes == tuple(str(i) for i in range(12))  # '2' is class 2, not class 4 ('10' < '2' as text)
    assert class_order(["b", "a", "10"]) == ("10", "a", "b")  # mixed labels: text order, as ImageFolder


@pytest.mark.parametrize("header", ["filename,class_id", "image;target", "file_name\tlabel_name", "a,b"])
def test_csv_headers_are_recognised(tmp_path, header):
    sep = ";" if ";" in header else "\t" if "\t" in header else ","
    (tmp_path / "x.jpg").write_bytes(photo(COLORS["red"]))
    (tmp_path / "y.jpg").write_bytes(photo(COLORS["blue"]))
    (tmp_path / "list.csv").write_text(f"{header}\nx.jpg{sep}red\ny.jpg{sep}blue\n")
    source = discover(tmp_path / "list.csv")
    assert len(source.items) == 2 and not source.rejections and source.classes == ("blue", "red")
    assert any("header row skipped" in n for n in source.notes)


def test_a_first_row_naming_a_missing_file_is_a_rejection_not_a_header(tmp_path):
    (tmp_path / "x.jpg").write_bytes(photo(COLORS["red"]))
    (tmp_path / "list.csv").write_text("imgs/gone.jpg,red\nx.jpg,red\n")
    source = discover(tmp_path / "list.csv")
    assert [r.reason for r in source.rejections] == ["missing"] and len(source.items) == 1


def test_one_class_and_no_val_are_said(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 4})
    summary = shard(cfg(src, tmp_path / "out"))
    text = "\n".join(summary.lines())
    assert "only one class" in text and "no validation samples" in text


def _photos(folder: Path, n: int) -> list[str]:
    for i in range(n):
        (folder / f"p{i}.jpg").write_bytes(photo(COLORS["red"], seed=i))
    return [f"p{i}.jpg" for i in range(n)]


@pytest.mark.parametrize("cell", ["2", "-1", "yes"])
def test_a_bad_cell_in_a_0_1_table_rejects_its_row_not_the_table(tmp_path, cell):
    """One cell of 2, -1 or 'yes' turned the table into a single-label list of its first column, the other
    columns silently dropped."""
    names = _photos(tmp_path, 6)
    rows = ["path,rust,scab,mildew"] + [f"{n},1,0,{1 if i % 2 else 0}" for i, n in enumerate(names)]
    rows[3] = f"{names[2]},1,{cell},0"
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    source = discover(tmp_path / "l.csv")
    assert source.multilabel and source.classes == ("rust", "scab", "mildew") and len(source.items) == 5
    (r,) = source.rejections
    assert (r.path, r.reason) == ("p2.jpg", "bad-label")
    assert f"line 4, column 'scab': '{cell}' is not 0 or 1" in r.detail
    assert any("one 0/1 column per class" in n for n in source.notes)


@pytest.mark.parametrize("header,says", [("path,rust,,mildew", "empty or repeated: ''"),
                                         ("path,rust,rust,mildew", "empty or repeated: 'rust'")])
def test_a_0_1_table_whose_header_is_malformed_is_refused(tmp_path, header, says):
    names = _photos(tmp_path, 3)
    (tmp_path / "l.csv").write_text("\n".join([header] + [f"{n},1,0,1" for n in names]) + "\n")
    with pytest.raises(DataError, match=says):
        discover(tmp_path / "l.csv")


def test_a_huge_cell_is_named_by_its_line(tmp_path):
    names = _photos(tmp_path, 2)
    (tmp_path / "l.csv").write_text(f"path,label\n{names[0]},red\n{names[1]},\"{'x' * 700_000}\"\n")
    with pytest.raises(DataError, match=r"l\.csv, line \d: not a readable CSV row"):
        discover(tmp_path / "l.csv")


def test_a_label_with_a_line_break_is_rejected_not_cut(tmp_path):
    names = _photos(tmp_path, 3)
    (tmp_path / "l.csv").write_text(f'{names[0]},red\n{names[1]},"re\nd"\n{names[2]},red\n')
    source = discover(tmp_path / "l.csv")
    assert [i.path for i in source.items] == [names[0], names[2]] and source.classes == ("red",)
    (r,) = source.rejections
    assert r.reason == "bad-label" and "a line break" in r.detail


def test_a_labels_header_makes_a_multi_label_list_even_without_a_pair(tmp_path):
    """Only one label per row and a few rows with none: it was read as single-label, the empty rows rejected as
    bad-row (164 of 181 rows lost, visible only in the summary)."""
    names = _photos(tmp_path, 6)
    rows = ["path,labels"] + [f"{n},{'rust' if i % 3 == 0 else ''}" for i, n in enumerate(names)]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    source = discover(tmp_path / "l.csv")
    assert source.multilabel and len(source.items) == 6 and not source.rejections
    assert any("the header names the label column 'labels'" in n for n in source.notes)
    single = tmp_path / "s.csv"
    single.write_text("path,label\n" + "".join(f"{n},red\n" for n in names))
    assert any("one label per row" in n for n in discover(single).notes)


def test_a_label_header_keeps_the_list_single_label_and_rejects_a_label_set(tmp_path):
    """One row 'rust;scab' under a 'path,label' header turned the whole data set multi-label, said only in a note."""
    names = _photos(tmp_path, 5)
    rows = ["path,label"] + [f"{n},{'scab' if i % 2 else 'rust'}" for i, n in enumerate(names)]
    rows[3] = f"{names[2]},rust;scab"
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    source = discover(tmp_path / "l.csv")
    assert not source.multilabel and source.classes == ("rust", "scab") and len(source.items) == 4
    (r,) = source.rejections
    assert (r.path, r.reason) == ("p2.jpg", "bad-label") and r.detail.startswith("line 4: 'rust;scab' is a label set")
    assert any("for a multi-label list name the label column 'labels'" in n for n in source.notes)


def test_a_list_without_a_header_that_mixes_labels_and_label_sets_is_refused(tmp_path):
    names = _photos(tmp_path, 6)
    rows = [f"{n},{'rust' if i < 4 else 'rust;scab'}" for i, n in enumerate(names)]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"one label \(lines 1, 2, 3, \.\.\.\) and some a label set \(lines 5, 6\).*"
                                        r"'path,labels' for label sets"):
        discover(tmp_path / "l.csv")
    (tmp_path / "sets.csv").write_text("".join(f"{n},{'rust;scab' if i % 2 else ''}\n" for i, n in enumerate(names)))
    assert discover(tmp_path / "sets.csv").multilabel  # sets and empty sets: nothing to guess


def test_a_row_with_more_columns_than_the_list_is_rejected(tmp_path):
    """'scab/IMG_SC0002.jpg,scab,extra' was taken, its third column dropped without a word."""
    names = _photos(tmp_path, 4)
    rows = ["path,label", f"{names[0]},rust", f"{names[1]},scab,extra", f"{names[2]},rust,", f"{names[3]},scab"]
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    source = discover(tmp_path / "l.csv")
    assert [i.path for i in source.items] == [names[0], names[2], names[3]]  # a padding comma is no column
    (r,) = source.rejections
    assert (r.path, r.reason) == ("p1.jpg", "bad-row") and r.detail.startswith("line 3: 3 columns where the list has 2")


def test_a_0_1_table_with_a_column_of_yes_and_no_keeps_its_columns(tmp_path):
    """A 'rust' column of yes/no made the table a single-label list of classes 'no' and 'yes', scab and mildew
    dropped."""
    names = _photos(tmp_path, 6)
    rows = ["path,rust,scab,mildew"] + [f"{n},{'yes' if i % 2 else 'no'},{i % 2},1" for i, n in enumerate(names)]
    rows[1], rows[2] = f"{names[0]},1,0,1", f"{names[1]},0,1,0"
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    source = discover(tmp_path / "l.csv")
    assert source.multilabel and source.classes == ("rust", "scab", "mildew") and len(source.items) == 2
    assert [(r.path, r.reason) for r in source.rejections] == [(n, "bad-label") for n in names[2:]]
    assert "line 4, column 'rust': 'no' is not 0 or 1" in source.rejections[0].detail
    (tmp_path / "all.csv").write_text("\n".join(rows[:1] + [f"{n},yes,0,1" for n in names]) + "\n")
    with pytest.raises(DataError, match=r"no usable .* the first: p0\.jpg: line 2, column 'rust': 'yes' is not 0"):
        discover(tmp_path / "all.csv")


@pytest.mark.parametrize("name", ["rust;early", "scab|late"])
def test_a_0_1_table_naming_a_class_with_a_label_separator_is_refused_by_name(tmp_path, name):
    """A class 'rust;early' became two labels in the shards: KeyError: 'early' while planning."""
    names = _photos(tmp_path, 3)
    (tmp_path / "l.csv").write_text("\n".join([f"path,{name},mildew"] + [f"{n},1,0" for n in names]) + "\n")
    with pytest.raises(DataError, match=f"names the class '{name}'.*rename that column"):
        discover(tmp_path / "l.csv")

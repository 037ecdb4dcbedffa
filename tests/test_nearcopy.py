"""Near-copies of one picture across the split: found at conversion (a resized, recompressed, cropped or brightened
copy), kept in one split, reported where SRC's own split straddles them, listed, and counted by inspect."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance

from fastpipe.cli import main
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.dataset import nearcopy


def natural(seed: int, size=(320, 240)) -> Image.Image:
    """A picture with a natural photo's spectrum (amplitude 1/f, random phases): unrelated seeds are unrelated
    pictures, as two photos of a collection are."""
    rng = np.random.default_rng(seed)
    w, h = size
    f = np.hypot(np.fft.rfftfreq(w)[None, :], np.fft.fftfreq(h)[:, None])
    f[0, 0] = 1
    chans = []
    for _ in range(3):
        a = np.fft.irfft2((rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) / f, s=(h, w))
        chans.append(np.clip(128 + 45 * (a - a.mean()) / a.std(), 0, 255))
    return Image.fromarray(np.stack(chans, -1).astype(np.uint8))


def jpeg(im: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


COPIES = {  # the transformed copies the fingerprint is made for
    "half": lambda im: im.resize((im.width // 2, im.height // 2), Image.Resampling.LANCZOS),
    "q50": lambda im: Image.open(io.BytesIO(jpeg(im, 50))),
    "crop": lambda im: im.crop((0, 0, int(im.width * 0.92), int(im.height * 0.92))),
    "darker": lambda im: ImageEnhance.Brightness(im).enhance(0.85),
}


def write(path: Path, im: Image.Image) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jpeg(im))


def groups_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "near-duplicates.jsonl").read_text().splitlines()]


def test_copies_are_found_and_unrelated_pictures_are_not():
    originals = [natural(s) for s in range(12)]
    fps = [nearcopy.fingerprint(Image.open(io.BytesIO(jpeg(im)))) for im in originals]
    for make in COPIES.values():
        fps += [nearcopy.fingerprint(Image.open(io.BytesIO(jpeg(make(im))))) for im in originals[:6]]
    found = {(a, b) for a, b, _ in nearcopy.pairs(np.stack(fps))}
    planted = {(k, 12 + 6 * c + k) for c in range(len(COPIES)) for k in range(6)}
    assert planted <= found  # every copy is paired with its original ...
    assert not {(a, b) for a, b in found if b < 12}  # ... and no two unrelated pictures are
    # nor a picture and the same picture squeezed to another shape (a portrait and a landscape photo thumbnail alike)
    squeezed = nearcopy.fingerprint(Image.open(io.BytesIO(jpeg(originals[0].resize((240, 320))))))
    assert not nearcopy.pairs(np.stack([fps[0], squeezed]))


def test_the_search_finds_what_comparing_every_pair_finds():
    """Multi-index hashing against brute force, on fingerprints with planted neighbours at 0 to 20 bits."""
    rng = np.random.default_rng(0)
    fps = rng.integers(0, 2**63, size=(300, len(nearcopy.WINDOWS) + 1, nearcopy.WORDS), dtype=np.uint64)
    fps[:, -1] = [np.float64(4 / 3).view(np.uint64), 0, 0, 0]  # every photo 4:3
    for k in range(0, 300, 3):  # photo k+1's whole picture: photo k's window k % 16 with a few bits flipped
        near = fps[k, k % len(nearcopy.WINDOWS)].copy()
        for bit in rng.choice(256, size=k % 21, replace=False):
            near[bit // 64] ^= np.uint64(1 << (bit % 64))
        fps[k + 1, 0] = near
    whole, stored = fps[:, 0], fps[:, :-1]
    brute = set()
    for i in range(len(fps)):
        d = nearcopy.popcount(whole[i] ^ stored).sum(-1).min(-1)  # to every photo's closest window
        for j in np.flatnonzero(d <= 16):
            if j != i:
                brute.add((min(i, j), max(i, j)))
    found = {(a, b) for a, b, _ in nearcopy.pairs(fps, 16)}
    assert found <= brute and len(found) >= 60
    # a pair within 16 bits is found unless its first 64 bits differ in more than COARSE (the index's reach)
    missed = brute - found
    for a, b in missed:
        closest = min(int(nearcopy.popcount(whole[x][0] ^ stored[y][:, 0]).min()) for x, y in ((a, b), (b, a)))
        assert closest > nearcopy.COARSE


@pytest.fixture
def given_split(tmp_path) -> Path:
    """SRC/train and SRC/val with copies of two train photos in val, and one under another label."""
    src = tmp_path / "src"
    for k in range(8):
        write(src / "train" / ("cat" if k % 2 else "dog") / f"p{k}.jpg", natural(k))
        write(src / "val" / ("cat" if k % 2 else "dog") / f"v{k}.jpg", natural(100 + k))
    write(src / "val" / "cat" / "p1_small.jpg", COPIES["half"](natural(1)))
    write(src / "val" / "dog" / "p2_crop.jpg", COPIES["crop"](natural(2)))
    write(src / "train" / "cat" / "p4_relabelled.jpg", COPIES["q50"](natural(4)))  # p4 is a dog
    return src


def test_copies_across_srcs_train_and_val_are_reported_and_can_leave_val(given_split, tmp_path, capsys):
    out = tmp_path / "out"
    shard(ShardConfig(given_split, out, short_side=64, workers=0))
    groups = groups_of(out)
    straddling = [g for g in groups if g["straddles"]]
    assert sorted(p["path"] for g in straddling for p in g["photos"]) == [
        "train/cat/p1.jpg", "train/dog/p2.jpg", "val/cat/p1_small.jpg", "val/dog/p2_crop.jpg"]
    conflict = next(g for g in groups if g["label_conflict"])
    assert {p["path"] for p in conflict["photos"]} == {"train/dog/p4.jpg", "train/cat/p4_relabelled.jpg"}
    near = json.loads((out / "dataset.json").read_text())["outputs"]["near_duplicates"]
    assert near["straddling"] == 2 and near["label_conflicts"] == 1 and near["groups"] == 3
    assert (near["mode"], near["threshold"]) == ("group", 16)  # recorded, defaults included
    assert (out / near["preview"]).stat().st_size > 5000  # previews/near-duplicates.jpg: the groups side by side
    assert main(["inspect", str(out)]) == 0
    assert "near-copies: 3 groups, 6 photos" in capsys.readouterr().out
    # the val copies removed, each a recorded rejection naming its train photo
    dropped = tmp_path / "dropped"
    shard(ShardConfig(given_split, dropped, short_side=64, workers=0, near_duplicates="drop-from-val"))
    rejected = [json.loads(line) for line in (dropped / "rejected.jsonl").read_text().splitlines()]
    assert {(r["path"], r["reason"]) for r in rejected} == {("val/cat/p1_small.jpg", "near-duplicate"),
                                                            ("val/dog/p2_crop.jpg", "near-duplicate")}
    assert "train/cat/p1.jpg" in next(r["detail"] for r in rejected if r["path"] == "val/cat/p1_small.jpg")
    counts = {n: s["samples"] for n, s in json.loads((dropped / "dataset.json").read_text())["splits"].items()}
    assert counts == {"train": 9, "val": 8}


def test_a_random_split_keeps_each_group_whole_and_is_the_same_with_any_worker_count(tmp_path):
    src = tmp_path / "src"
    for k in range(30):
        write(src / ("a" if k % 2 else "b") / f"p{k:02d}.jpg", natural(k))
    for k in range(0, 30, 3):  # ten pictures with two copies each
        for name in ("half", "crop"):
            write(src / ("a" if k % 2 else "b") / f"p{k:02d}_{name}.jpg", COPIES[name](natural(k)))
    outs = [tmp_path / f"out{w}" for w in (0, 2)]
    for w, out in zip((0, 2), outs):
        shard(ShardConfig(src, out, short_side=64, val_fraction=0.3, workers=w))
    groups = groups_of(outs[0])
    assert len(groups) == 10 and all(len(g["photos"]) == 3 and not g["straddles"] for g in groups)
    assert {g["photos"][0]["split"] for g in groups} == {"train", "val"}  # groups do go to val, whole
    files = [sorted(p.relative_to(o) for p in o.rglob("*") if p.is_file()) for o in outs]
    assert files[0] == files[1]
    assert all((outs[0] / f).read_bytes() == (outs[1] / f).read_bytes() for f in files[0])


def test_drop_keeps_the_original_of_each_group(tmp_path):
    src = tmp_path / "src"
    for k in range(6):
        write(src / ("a" if k % 2 else "b") / f"p{k}.jpg", natural(k))
    write(src / "a" / "p1 (copy).jpg", COPIES["darker"](natural(1)))
    out = tmp_path / "out"
    shard(ShardConfig(src, out, short_side=64, workers=0, val_fraction=0, near_duplicates="drop"))
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["path"], r["reason"]) for r in rejected] == [("a/p1 (copy).jpg", "near-duplicate")]


@pytest.mark.parametrize("argv,said", [
    (["--near-threshold", "-1"], "--near-threshold"), (["--near-threshold", "65"], "--near-threshold"),
    (["--near-threshold", "nan"], "--near-threshold"), (["--near-duplicates", "maybe"], "--near-duplicates")])
def test_bad_values_of_the_near_copy_options_are_refused_in_one_line(tmp_path, capsys, argv, said):
    try:
        code = main(["shard", str(tmp_path), str(tmp_path / "out"), *argv])
    except SystemExit as e:  # refused by the parser
        code = e.code
    assert code == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert said in err[-1] and "Traceback" not in "\n".join(err)


def test_inspect_against_another_set_finds_the_planted_copies(tmp_path, capsys, monkeypatch):
    """A test set against a training set: the test photos that are copies of training photos, with a picture."""
    train_src, test_src = tmp_path / "train-src", tmp_path / "test-src"
    for k in range(10):
        write(train_src / ("a" if k % 2 else "b") / f"t{k}.jpg", natural(k))
        write(test_src / ("a" if k % 2 else "b") / f"n{k}.jpg", natural(50 + k))
    write(test_src / "a" / "leak1.jpg", COPIES["half"](natural(3)))
    write(test_src / "b" / "leak2.jpg", COPIES["crop"](natural(4)))
    for src in (train_src, test_src):
        shard(ShardConfig(src, tmp_path / src.name.replace("src", "set"), short_side=64, workers=0))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "test-set"), "--against", str(tmp_path / "train-set")]) == 0
    said = capsys.readouterr().out
    assert "2 of the 12 photos of" in said
    assert "train/a/leak1.jpg  ~  train/a/t3.jpg  (" in said and "train/b/leak2.jpg  ~  train/b/t4.jpg  (" in said
    assert (tmp_path / "near-copies.jpg").stat().st_size > 3000
    # a set converted without fingerprints says how to get them, in one line
    shard(ShardConfig(train_src, tmp_path / "plain-set", short_side=64, workers=0, near_duplicates="off"))
    assert main(["inspect", str(tmp_path / "test-set"), "--against", str(tmp_path / "plain-set")]) == 2
    assert "holds no fingerprints" in capsys.readouterr().err


def test_a_fingerprint_table_naming_paths_outside_its_source_is_not_followed(tmp_path):
    """fingerprints.npz comes with a data set from anywhere: a path in it that climbs out of the source folder is
    never read for the picture."""
    from fastpipe.convert import against
    from fastpipe.dataset.loading import load

    src = tmp_path / "src"
    for k in range(4):
        write(src / ("a" if k % 2 else "b") / f"p{k}.jpg", natural(k))
    shard(ShardConfig(src, tmp_path / "set", short_side=64, workers=0))
    secret = tmp_path / "secret.jpg"
    write(secret, natural(9))
    m = load(tmp_path / "set")
    rows = [{"a_split": "train", "a_path": "../secret.jpg", "b_split": "train", "b_path": "../secret.jpg",
             "bits": 0}]
    assert not against.picture(rows, m, m, tmp_path / "out.jpg")  # nothing read, nothing drawn


def test_predict_says_which_photos_are_near_copies_of_the_runs_training_photos(tmp_path, capsys):
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import train

    src = tmp_path / "src"
    for k in range(16):
        write(src / ("a" if k % 2 else "b") / f"p{k:02d}.jpg", natural(k))
    shard(ShardConfig(src, tmp_path / "set", short_side=64, workers=0, val_fraction=0.25))
    run = train(TrainConfig(data=str(tmp_path / "set"), out=str(tmp_path / "run"), model="resnet18", batch_size=4,
                            image_size=32, workers=0, device="cpu", epochs=1, log_every=4))
    split = dict(zip(*[np.load(tmp_path / "set" / "fingerprints.npz")[k].tolist() for k in ("path", "split")]))
    train_photo = next(p for p, s in sorted(split.items()) if s == "train")
    new = tmp_path / "new"
    write(new / "copy.jpg", COPIES["half"](Image.open(src / train_photo)))
    write(new / "fresh.jpg", natural(999))
    capsys.readouterr()
    assert main(["predict", str(run), str(new), "--out", str(tmp_path / "p.csv")]) == 0
    rows = {Path(r["path"]).name: r for r in csv_rows(tmp_path / "p.csv")}
    assert rows["copy.jpg"]["detail"].startswith(f"a near-copy of the training photo {train_photo} (")
    assert rows["fresh.jpg"]["detail"] == ""
    assert "note: 1 photos are near-copies of photos this run trained on" in capsys.readouterr().out


def csv_rows(path: Path) -> list[dict]:
    import csv

    return list(csv.DictReader(path.open()))


def test_a_thousand_copies_of_one_picture_cost_one_and_blank_frames_none():
    """Identical fingerprints are linked to the first of them; plain ones (a black frame) are never candidates: the
    search stays linear in them (a thousand black frames made 1.5 GB of candidate pairs)."""
    one = nearcopy.fingerprint(Image.open(io.BytesIO(jpeg(natural(1)))))
    black = nearcopy.fingerprint(Image.open(io.BytesIO(jpeg(Image.new("RGB", (320, 240))))))
    assert nearcopy.plain(black[None])[0] and not nearcopy.plain(one[None])[0]
    found = nearcopy.pairs(np.stack([one] * 1000 + [black] * 1000))
    assert found == [(0, k, 0) for k in range(1, 1000)]


@pytest.mark.parametrize("damage", ["object", "names", "truncated", "shape"])
def test_a_damaged_or_crafted_fingerprint_table_is_refused_in_one_line(tmp_path, capsys, damage):
    """fingerprints.npz comes with a data set from anywhere: pickled objects, other members, a cut file or other
    shapes are refused by inspect --against in one line, and predict leaves its note out rather than failing."""
    src = tmp_path / "src"
    for k in range(4):
        write(src / ("a" if k % 2 else "b") / f"p{k}.jpg", natural(k))
    out = tmp_path / "set"
    shard(ShardConfig(src, out, short_side=64, workers=0))
    table = out / "fingerprints.npz"
    if damage == "object":
        np.savez(table, split=np.array(["train"], dtype=object), path=np.array(["x"], dtype=object),
                 fingerprint=np.zeros((1, 17, 4), np.uint64))
    elif damage == "names":
        np.savez(table, other=np.zeros(3))
    elif damage == "truncated":
        table.write_bytes(table.read_bytes()[:200])
    else:
        np.savez(table, split=np.array(["train"]), path=np.array(["x"]), fingerprint=np.zeros((1, 3), np.uint64))
    capsys.readouterr()
    assert main(["inspect", str(out), "--against", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a fingerprint table fastpipe wrote" in err[0]


def test_each_photo_is_decoded_once_with_fingerprints_and_nothing_is_left_behind(tmp_path, monkeypatch):
    """The fingerprint is taken while hashing, from the photo converted then (spool.py): converting does not decode
    it again, and the converted photos kept in between are gone when the conversion ends."""
    from fastpipe.convert import images

    src = tmp_path / "src"
    for k in range(6):
        write(src / ("a" if k % 2 else "b") / f"p{k}.jpg", natural(k))
    calls, real = [], images.process
    monkeypatch.setattr(images, "process", lambda data, settings: calls.append(1) or real(data, settings))
    out = tmp_path / "out"
    shard(ShardConfig(src, out, short_side=64, workers=0))
    assert len(calls) == 6
    assert not (out / ".fastpipe-spool").exists()
    off = tmp_path / "off"
    shard(ShardConfig(src, off, short_side=64, workers=0, near_duplicates="off"))
    assert len(calls) == 12  # without fingerprints: converted once too
    same = [p.relative_to(out) for p in out.rglob("*.tar")]
    assert same and all((out / p).read_bytes() == (off / p).read_bytes() for p in same)


def test_with_worker_processes_the_photos_are_converted_by_them_not_by_the_calling_process(tmp_path, monkeypatch):
    """Taking fingerprints converts each photo while hashing: with worker processes, they do it (threads of the
    calling process would hold its GIL for Pillow's Python), and the result is the one-process conversion's."""
    from fastpipe.convert import images

    src = tmp_path / "src"
    for k in range(6):
        write(src / ("a" if k % 2 else "b") / f"p{k}.jpg", natural(k))
    calls, real = [], images.process
    monkeypatch.setattr(images, "process", lambda data, settings: calls.append(1) or real(data, settings))
    shard(ShardConfig(src, tmp_path / "two", short_side=64, workers=2))
    assert calls == []  # a worker's calls stay in the worker: none here
    shard(ShardConfig(src, tmp_path / "one", short_side=64, workers=0))
    assert len(calls) == 6
    same = [p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.tar")]
    assert same and all((tmp_path / "one" / p).read_bytes() == (tmp_path / "two" / p).read_bytes() for p in same)


def test_a_conversion_stopped_while_hashing_reuses_the_photos_it_converted(tmp_path, monkeypatch):
    """The photos converted while hashing are kept under OUT until the conversion ends: a rerun after Ctrl-C there
    converts none of them again."""
    from fastpipe.convert import images, spool

    src = tmp_path / "src"
    for k in range(6):
        write(src / ("a" if k % 2 else "b") / f"p{k}.jpg", natural(k))
    calls, real = [], images.process

    def stopped_at_the_fourth(data, settings):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(data, settings)

    monkeypatch.setattr(images, "process", stopped_at_the_fourth)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        shard(ShardConfig(src, out, short_side=64, workers=0))
    assert len(list((out / spool.FOLDER).rglob("*" + spool.SUFFIX))) == 3
    monkeypatch.setattr(images, "process", lambda data, settings: calls.append(1) or real(data, settings))
    shard(ShardConfig(src, out, short_side=64, workers=0))
    assert len(calls) == 6 and not (out / spool.FOLDER).exists()  # three then, the other three now


def test_a_spool_entry_a_crash_damaged_is_converted_again(tmp_path):
    """Entries are not synced (a cache): one cut short or with a flipped byte reads as absent, never as a photo."""
    from fastpipe.convert import images, spool

    photo = io.BytesIO()
    natural(1).save(photo, "JPEG")
    enc = images.process(photo.getvalue(), images.ImageSettings(short_side=64))
    spool.put(tmp_path, "ab", enc)
    assert spool.take(tmp_path, "ab", 10**6) == enc
    entry = tmp_path / ("ab" + spool.SUFFIX)
    data = entry.read_bytes()
    for damaged in (data[:-1], data[:-9] + bytes([data[-9] ^ 1]) + data[-8:], data[: data.index(b"\n")]):
        entry.write_bytes(damaged)
        assert spool.take(tmp_path, "ab", 10**6) is None
    assert spool.take(tmp_path, "missing", 10**6) is None


def test_spool_entries_written_at_once_by_threads_and_links_planted_in_it(tmp_path):
    """Threads (a store's photos are hashed in threads) may convert the same bytes at once: every write lands whole,
    none fails. An entry that is a link (planted, never made by fastpipe) is not followed: the photo is converted
    again."""
    import threading

    from fastpipe.convert import images, spool

    photo = io.BytesIO()
    natural(2).save(photo, "JPEG")
    enc = images.process(photo.getvalue(), images.ImageSettings(short_side=64))
    errors = []

    def write():
        try:
            for _ in range(40):
                spool.put(tmp_path, "cd", enc)
        except Exception as e:  # the test's subject: none may happen
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and spool.take(tmp_path, "cd", 10**6) == enc
    assert [p.name for p in tmp_path.iterdir()] == ["cd" + spool.SUFFIX]  # no temporary file left
    (tmp_path / ("ef" + spool.SUFFIX)).symlink_to(tmp_path / ("cd" + spool.SUFFIX))
    assert spool.take(tmp_path, "ef", 10**6) is None

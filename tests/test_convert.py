"""`fastpipe shard` end to end: sources, rejections, split, determinism, resume, parts, foreign shards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import COLORS, make_folder, photo

from fastpipe.convert.driver import ConvertError, ShardConfig, shard
from fastpipe.convert.inspect import inspect
from fastpipe.dataset.loading import load
from fastpipe.dataset.shardformat import read_index
from fastpipe.errors import ConfigError, DataError

wds = pytest.importorskip("webdataset")  # absent on the GPU test machine: these tests run in CI


def cfg(src, out, **kw) -> ShardConfig:
    kw.setdefault("short_side", 48)
    kw.setdefault("workers", 1)
    return ShardConfig(Path(src), Path(out), **kw)


def rejected(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]


def tree_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar")) + sorted(out.glob("*.idx"))}


READERS = ["_info.json", "wids-train.json", "wids-val.json"]


def readers_bytes(out: Path) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in READERS}


def check_readers(out: Path) -> None:
    """timm's info and the wids descriptors are written, listed as fastpipe's, and describe the shards as
    dataset.json does."""
    m = load(out)
    assert sorted(m.outputs["readers"]) == READERS
    info = json.loads((out / "_info.json").read_text())["splits"]
    for name, sp in m.splits.items():
        assert info[name] == {"name": name, "num_samples": sp.samples, "filenames": [s.path for s in sp.shards],
                              "shard_lengths": [s.samples for s in sp.shards]}
        wids = json.loads((out / f"wids-{name}.json").read_text())
        assert wids["wids_version"] == 1
        assert [(d["url"], d["nsamples"]) for d in wids["shardlist"]] == [(s.path, s.samples) for s in sp.shards]


def test_folder_conversion_writes_everything(folder, tmp_path):
    out = tmp_path / "out"
    summary = shard(cfg(folder, out, val_fraction=0.25))
    m = load(out)
    assert m.classes == ("blue", "green", "red")
    assert summary.written == {"train": 18, "val": 6} and sum(summary.rejected.values()) == 0
    assert m.splits["train"].class_counts == (3, 6, 9) and m.splits["val"].class_counts == (1, 2, 3)
    # Per-channel mean of a red/green/blue set: red channel dominated by the 12 red images.
    assert m.mean[0] > m.mean[2] and all(0 < s < 0.5 for s in m.std)
    assert m.class_weights()[0] == pytest.approx(18 / (3 * 3))
    assert sorted(p.name for p in (out / "previews").iterdir()) == ["blue.jpg", "green.jpg", "red.jpg"]
    for sp in m.splits.values():
        for s in sp.shards:
            assert (out / s.path).is_file() and len(read_index(out / s.index)) == s.samples


def test_shards_read_back_with_webdataset(converted):
    m = load(converted)
    ds = wds.WebDataset(m.shard_paths("train"), shardshuffle=False).decode("rgb8")
    seen = 0
    for sample in ds:
        img, label, meta = sample["jpg"], int(sample["cls"]), sample["json"]
        assert img.shape[2] == 3 and min(img.shape[:2]) == 64
        assert int(np.frombuffer(sample["lbl"], "<i4")[0]) == label == meta["label"]
        # The class is the dominant colour channel.
        assert m.classes[label] == ["red", "green", "blue"][int(np.argmax(img.reshape(-1, 3).mean(0)))]
        seen += 1
    assert seen == m.splits["train"].samples


def test_idx_matches_dalis_own_wds2idx(converted, tmp_path):
    wds2idx = Path(sys.executable).with_name("wds2idx")
    if not wds2idx.exists():
        pytest.skip("DALI's wds2idx not installed")
    m = load(converted)
    shard0 = m.splits["train"].shards[0]
    subprocess.run([str(wds2idx), str(converted / shard0.path), str(tmp_path / "x.idx")], check=True,
                   capture_output=True)
    assert (tmp_path / "x.idx").read_text() == (converted / shard0.index).read_text()


@pytest.mark.dali
def test_idx_files_are_accepted_by_dalis_reader(converted):
    from nvidia.dali import fn, pipeline_def, types

    m = load(converted)

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def pipe():
        jpg, lbl = fn.readers.webdataset(paths=m.shard_paths("train"), index_paths=[
            str(converted / s.index) for s in m.splits["train"].shards], ext=["jpg", "lbl"],
            dtypes=[types.UINT8, types.INT32], name="r")
        return fn.decoders.image(jpg, device="cpu"), lbl

    p = pipe()
    p.build()
    assert p.reader_meta("r")["epoch_size"] == m.splits["train"].samples
    images, labels = p.run()
    assert len(labels.as_array()) == 4 and images.at(0).shape[2] == 3


def test_every_rejection_reason_from_a_folder(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 3, "green": 3})
    (src / "red" / "empty.jpg").write_bytes(b"")
    (src / "red" / "notes.txt").write_text("hello")
    (src / "red" / "cut.jpg").write_bytes(photo(COLORS["red"], (300, 200), seed=9)[:900])
    (src / "red" / "dup.jpg").write_bytes((src / "red" / "img_000.jpg").read_bytes())
    (src / "green" / "stolen.jpg").write_bytes((src / "red" / "img_001.jpg").read_bytes())
    (src / "green" / "huge.png").write_bytes(photo(COLORS["green"], (400, 400), fmt="PNG"))
    (src / "green" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (src / "green" / ".DS_Store").write_bytes(b"junk")
    (src / ".hidden").mkdir()
    (src / ".hidden" / "x.jpg").write_bytes(photo(COLORS["red"]))
    out = tmp_path / "out"
    summary = shard(cfg(src, out, max_pixels=100_000))
    reasons = {r["path"]: r["reason"] for r in rejected(out)}
    assert reasons == {
        "red/empty.jpg": "empty", "red/notes.txt": "not-an-image", "red/cut.jpg": "truncated",
        "red/img_000.jpg": "duplicate",  # dup.jpg, the shorter name, is kept
        "red/img_001.jpg": "label-conflict", "green/stolen.jpg": "label-conflict",
        "green/huge.png": "too-large", "green/dangling.jpg": "unreadable",
    }
    # Nothing lost: every discovered file is a sample or a rejection.
    assert summary.discovered == 13 == sum(summary.written.values()) + len(reasons)


def test_list_source_with_hostile_rows(tmp_path):
    data = tmp_path / "data"
    make_folder(data / "imgs", {"red": 3, "blue": 3})
    (tmp_path / "secret.jpg").write_bytes(photo(COLORS["red"]))
    (data / "imgs" / "a, b.jpg").write_bytes(photo(COLORS["blue"], seed=77))
    rows = ["path,label", "imgs/red/img_000.jpg,red", "imgs/red/img_001.jpg,red", "imgs/red/img_002.jpg,red",
            "imgs/blue/img_000.jpg,blue", f"{data}/imgs/blue/img_001.jpg,blue", '"imgs/a, b.jpg",blue',
            "../secret.jpg,red", f"{tmp_path}/secret.jpg,red", "imgs/missing.jpg,red", "imgs/red/img_000.jpg",
            ""]
    (data / "list.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    summary = shard(cfg(data / "list.csv", out, val_fraction=0))
    assert summary.written["train"] == 6
    got = sorted((r["path"], r["reason"]) for r in rejected(out))
    assert got == sorted([("../secret.jpg", "outside-root"), (f"{tmp_path}/secret.jpg", "outside-root"),
                          ("imgs/missing.jpg", "missing"), ("<line 11>", "bad-row")])  # file line numbers


def test_stratified_split_is_seeded(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 30, "green": 20, "blue": 10}, size=(40, 30))
    a = shard(cfg(src, tmp_path / "a", val_fraction=0.2, seed=1))
    assert a.written == {"train": 48, "val": 12}
    assert load(tmp_path / "a").splits["val"].class_counts == (2, 4, 6)
    shard(cfg(src, tmp_path / "b", val_fraction=0.2, seed=2))
    shard(cfg(src, tmp_path / "c", val_fraction=0.2, seed=1))
    paths = {k: sorted(json.loads(s["json"])["path"] for s in
                       wds.WebDataset(load(tmp_path / k).shard_paths("val"), shardshuffle=False))
             for k in "abc"}
    assert paths["a"] == paths["c"] != paths["b"]


def test_source_train_val_folders_are_kept(tmp_path):
    make_folder(tmp_path / "src" / "train", {"red": 4, "blue": 3})
    make_folder(tmp_path / "src" / "val", {"red": 2, "blue": 1}, seed=5)
    shard(cfg(tmp_path / "src", tmp_path / "out", val_fraction=0.5))
    m = load(tmp_path / "out")
    assert m.splits["train"].class_counts == (3, 4) and m.splits["val"].class_counts == (1, 2)


def test_shards_mix_classes_and_respect_the_size_limit(converted):
    m = load(converted)
    for s in m.splits["train"].shards:
        assert s.bytes <= 64 * 1024
        labels = {int(x["cls"]) for x in wds.WebDataset(str(converted / s.path), shardshuffle=False)}
        assert len(labels) >= 2 or s.samples < 4


def test_two_runs_give_identical_bytes_whatever_the_workers(folder, tmp_path):
    shard(cfg(folder, tmp_path / "a", max_shard_size=64 * 1024, workers=1))
    shard(cfg(folder, tmp_path / "b", max_shard_size=64 * 1024, workers=2))
    a, b = tree_bytes(tmp_path / "a"), tree_bytes(tmp_path / "b")
    assert len(a) > 2 and a == b
    assert readers_bytes(tmp_path / "a") == readers_bytes(tmp_path / "b")
    # previews too: drawn in the main process with one worker, by the pool with two
    sheets = [{p.name: p.read_bytes() for p in (tmp_path / x / "previews").iterdir()} for x in "ab"]
    assert len(sheets[0]) == 3 and sheets[0] == sheets[1]
    with tarfile.open(tmp_path / "a" / "train-000000.tar") as tf:
        assert all(m.mtime == 0 and m.uid == 0 for m in tf.getmembers())


def test_rerun_is_a_no_op_and_other_settings_need_overwrite(folder, tmp_path):
    out = tmp_path / "out"
    shard(cfg(folder, out))
    again = shard(cfg(folder, out))
    assert again.up_to_date and again.converted_now == 0
    with pytest.raises(ConvertError, match=r"other settings: --quality 70 \(OUT has 90\), --seed 3 \(OUT has 0\)\. "
                                           r"Use --overwrite"):
        shard(cfg(folder, out, quality=70, seed=3))
    (folder / "red" / "new.jpg").write_bytes(photo(COLORS["red"], seed=999))
    with pytest.raises(ConvertError, match="other input files, with the same settings: files were added"):
        shard(cfg(folder, out))
    replaced = shard(cfg(folder, out, quality=70, overwrite=True))
    assert replaced.converted_now == 25 and load(out).settings["quality"] == 70


def test_killed_run_resumes_to_identical_bytes(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 50, "green": 50, "blue": 50}, size=(800, 600))
    # shards cut by size and by --min-shards' equal sample counts: a resumed run cuts both where the first did
    args = [str(src), "--short-side", "96", "--max-shard-size", "64KB", "--min-shards", "4", "--workers", "1"]
    clean = tmp_path / "clean"
    assert subprocess.run([sys.executable, "-m", "fastpipe", "shard", *args[:1], str(clean), *args[1:]],
                          capture_output=True).returncode == 0
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "fastpipe", "shard", args[0], str(out), *args[1:]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while len(list(out.glob("train-*.tar"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "dataset.json").exists(), "the run finished before it could be killed"
    rerun = shard(cfg(src, out, short_side=96, max_shard_size=64 * 1024, min_shards=4))
    assert 0 < rerun.converted_now < 150
    assert tree_bytes(out) == tree_bytes(clean)
    assert readers_bytes(out) == readers_bytes(clean)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".fastpipe-progress*"))


def _dies_on_the_victim(path: str):
    """The converter's per-image step, killed by the system on one photo (runs in the forked worker processes)."""
    from fastpipe.convert.images import process
    from fastpipe.util import read_regular

    if path == os.environ["FASTPIPE_TEST_VICTIM"]:  # the environment: workers may import this module afresh
        os.kill(os.getpid(), signal.SIGKILL)
    return process(read_regular(Path(path), 1 << 30), _worker_settings())


def _worker_settings():
    from fastpipe.convert import photos

    return photos._STATE[0]


def test_a_worker_that_dies_ends_the_run_naming_its_files_and_the_rerun_resumes(tmp_path, monkeypatch):
    """A conversion worker killed mid-run (the out-of-memory killer, a crash in a decoder): multiprocessing.Pool
    waited for its task forever. Now the run stops at once with the files that were in flight, and the same
    command resumes to the bytes of an uninterrupted run."""
    from fastpipe.convert import photos
    from fastpipe.convert.workers import WorkerDied

    src = make_folder(tmp_path / "src", {"red": 30, "green": 30, "blue": 30}, size=(160, 120))
    kw = dict(short_side=48, max_shard_size=64 * 1024, workers=2)
    shard(cfg(src, tmp_path / "clean", **kw))
    victim = str(src / "green" / "img_017.jpg")
    monkeypatch.setenv("FASTPIPE_TEST_VICTIM", victim)
    convert = photos.convert_one
    monkeypatch.setattr(photos, "convert_one", _dies_on_the_victim)
    out = tmp_path / "out"
    def hung(*_):
        raise TimeoutError("the conversion hung")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with pytest.raises(WorkerDied, match="worker process died") as died:
            shard(cfg(src, out, **kw))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert victim in str(died.value)
    assert not (out / "dataset.json").exists()
    monkeypatch.setattr(photos, "convert_one", convert)
    rerun = shard(cfg(src, out, **kw))
    assert rerun.converted_now < 90 or not list(out.glob("train-*.tar"))  # resumed, when a shard was finished
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


def _dies_on_three(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x * 10


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_worker_pool_gives_results_in_order_and_says_when_a_worker_dies(method, monkeypatch):
    """The converter's pool on its own (it also draws the previews, whose tasks are not file names): results in
    order across chunks and workers, and a dead worker named as such, not a hang; forked, and spawned as it is
    when the converting process holds CUDA or DALI (util.pool_context)."""
    import multiprocessing

    from fastpipe.convert import workers
    from fastpipe.convert.workers import WorkerDied, Workers

    monkeypatch.setattr(workers, "pool_context", lambda: multiprocessing.get_context(method))
    pool = Workers(2, int, ())
    try:
        assert f"{method.title()}Process" in {type(p).__name__ for p in multiprocessing.active_children()}
        assert list(pool.imap(abs, range(-9, 0), chunksize=2)) == list(range(9, 0, -1))
        with pytest.raises(WorkerDied, match=r"died .* with \d+ tasks in flight"):
            list(pool.imap(_dies_on_three, range(10), chunksize=1))
    finally:
        pool.terminate()


def test_a_pool_already_broken_when_a_task_is_queued_says_a_worker_died():
    """A worker may die between two tasks: then queueing the next one fails (it raised BrokenProcessPool, a
    traceback, instead of naming the files in flight)."""
    from concurrent.futures.process import BrokenProcessPool

    from fastpipe.convert.workers import WorkerDied, Workers

    pool = Workers(1, int, ())
    try:
        held = pool.executor.submit(time.sleep, 60)  # occupies the worker until it is killed
        child = next(iter(pool.executor._processes.values()))
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):
            held.result(timeout=60)  # the pool knows it is broken: the next submit fails
        with pytest.raises(WorkerDied, match=r"while converting one of: a\.jpg"):
            list(pool.imap(len, ["a.jpg", "b.jpg"]))
    finally:
        pool.terminate()


_HALF_SENT = """
import os, struct, sys, threading, time
from fastpipe.convert.workers import Workers

def half_sent(marker):  # in the worker: the first bytes of a result, then nothing, as when killed while sending
    f = sys._getframe()
    while "result_queue" not in f.f_locals:
        f = f.f_back
    os.write(f.f_locals["result_queue"]._writer.fileno(), struct.pack("!i", 1 << 20) + bytes(10))
    open(marker, "w").close()
    time.sleep(600)

if __name__ == "__main__":
    pool = Workers(1, int, ())
    threading.Thread(target=lambda: list(pool.imap(half_sent, [sys.argv[1]])), daemon=True).start()
    deadline = time.time() + 240
    while not os.path.exists(sys.argv[1]) and time.time() < deadline:
        time.sleep(0.02)
    pool.terminate()  # Ctrl-C: what the converter does, then the process ends
    print("terminated", flush=True)
"""


def test_a_process_whose_pool_is_stopped_while_a_worker_sends_its_result_ends(tmp_path):
    """Ctrl-C while a worker was sending its result (a whole shard's JPEGs) left half a message in the result pipe:
    the pool's thread waited for the rest, the interpreter's exit waited for that thread, and `fastpipe shard`
    said "interrupted" but never ended."""
    script = tmp_path / "half_sent.py"
    script.write_text(_HALF_SENT)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "sending")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=300)  # a bound, not a timing: ends at once, or never
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    assert out == "terminated\n" and p.returncode == 0, (out, err[-2000:])


def _faults_per_photo(paths: list[str]) -> float:
    """In a worker: page faults per photo converted, after a first one that grows the heap."""
    import resource

    from fastpipe.convert.photos import convert_one

    convert_one(paths[0])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for p in paths[1:]:
        convert_one(p)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (len(paths) - 1)


def test_the_allocator_setting_is_left_alone_outside_glibc(monkeypatch):
    """musl, macOS, Windows: no mallopt to call, nothing changed, and the conversion goes on."""
    import platform

    from fastpipe.util import reuse_freed_memory

    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))
    assert reuse_freed_memory() is False


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_conversion_workers_reuse_the_memory_they_free(tmp_path, monkeypatch):
    """A conversion worker keeps the memory it frees for the next photo (util.reuse_freed_memory). With glibc's
    defaults a fresh process got each photo's megabyte buffers as new pages, a page fault each: about 950 faults
    and 14 % of a demo photo's worker CPU (benchmarks/bench_malloc.py). Spawned, so the worker starts cold whatever
    this test process allocated before; the control is a spawned process without the setting."""
    import multiprocessing

    from fastpipe.convert import photos, workers
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.images import ImageSettings

    make_demo_data(DemoConfig(tmp_path / "raw", count=8, width=1632, height=1224))
    paths = sorted(str(p) for p in (tmp_path / "raw").rglob("*.jpg"))
    args = (ImageSettings(), 1 << 30)
    monkeypatch.setattr(workers, "pool_context", lambda: multiprocessing.get_context("spawn"))
    pool = workers.Workers(1, photos.init_worker, args)
    try:
        tuned = next(pool.imap(_faults_per_photo, [paths]))
    finally:
        pool.terminate()
    with multiprocessing.get_context("spawn").Pool(1, photos.init_worker, args) as plain:
        default = plain.apply(_faults_per_photo, (paths,))
    assert tuned < 100, f"{tuned:.0f} page faults per photo in a conversion worker"
    assert default > 4 * tuned, (default, tuned)  # the control: what the setting is there for


def test_ctrl_c_while_a_shard_closes_leaves_a_folder_the_rerun_resumes(tmp_path, monkeypatch):
    """Ctrl-C between a shard's index and its final name left an index no journal line listed, and the rerun
    refused it as a file fastpipe did not write. Now a shard closes whole (synced, indexed, named, journaled),
    then the interrupt stops the run, and the rerun resumes to the bytes of an uninterrupted run."""
    src = make_folder(tmp_path / "src", {"red": 12, "green": 12}, size=(160, 120))
    kw = dict(max_shard_size=64 * 1024, val_fraction=0)
    shard(cfg(src, tmp_path / "clean", **kw))
    real, sent = os.replace, []

    def replace(a, b):  # the first shard's rename: Ctrl-C arrives just before it
        if str(a).endswith(".tar.tmp") and not sent:
            sent.append(a)
            # to this thread: os.kill would send it to the process, which the kernel may hand to any other thread
            # (a library's), whose handler runs whenever that thread is next scheduled: on a busy machine, after
            # the shard closed
            signal.raise_signal(signal.SIGINT)
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    handlers = {s.name: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # said if this fails
    with pytest.raises(KeyboardInterrupt):
        shard(cfg(src, out, **kw))
    monkeypatch.setattr(os, "replace", real)
    assert sent and not list(out.glob("*.tmp")), (handlers, sorted(p.name for p in out.iterdir()))
    with pytest.raises(ConvertError, match=r"--short-side 40 \(OUT has 48\)"):  # from the journal: no dataset.json
        shard(cfg(src, out, **kw, short_side=40))
    rerun = shard(cfg(src, out, **kw))
    assert 0 < rerun.converted_now < 24
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")
    text = "\n".join(rerun.lines())  # its figures are the rerun's own, and say so
    assert f"{rerun.converted_now} images processed in this run" in text, text
    assert f"{24 - rerun.converted_now} were converted by an earlier run, resumed here" in text, text


def test_parts_then_merge_equal_one_run(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 10, "green": 7, "blue": 5})
    elsewhere = shutil.copytree(src, tmp_path / "node-2" / "scratch")  # a node with the photos at another path
    out = tmp_path / "parts"
    for i in range(3):
        shard(cfg(elsewhere if i == 2 else src, out, parts=3, part=i, max_shard_size=64 * 1024))
    assert not (out / "dataset.json").exists()
    from fastpipe.convert.merge import merge_parts

    merged = merge_parts(out)
    single = tmp_path / "single"
    shard(cfg(src, single, max_shard_size=64 * 1024))
    one = load(single)
    assert merged.splits["train"].class_counts == one.splits["train"].class_counts
    assert merged.mean == pytest.approx(one.mean) and merged.std == pytest.approx(one.std)
    keys = lambda m, sp: sorted(x["__key__"] for x in wds.WebDataset(m.shard_paths(sp), shardshuffle=False))  # noqa: E731
    assert keys(load(out), "train") == keys(one, "train")
    # previews: one sheet per class, drawn from the parts' recorded samples, recorded in the merged manifest
    assert sorted(p.name for p in (out / "previews").iterdir()) == ["blue.jpg", "green.jpg", "red.jpg"]
    assert set(load(out).outputs["previews"]) == {"red", "green", "blue"}
    assert "preview_candidates" not in load(out).outputs
    check_readers(out)  # written by the merge, from every part's shards


def test_merged_previews_are_a_uniform_sample_of_each_class():
    """Each part records a uniform sample of up to 9 of a class's images; merge takes from each part a number
    drawn multivariate-hypergeometrically: every image of the class is then equally likely to be shown, however
    the parts divide it (here 3 + 20 + 1 images, 9 shown)."""
    from fastpipe.convert.previews import from_candidates

    sizes, shown = [3, 20, 1], 9
    seen = np.zeros(sum(sizes))
    rounds = 3000
    rng = np.random.default_rng(0)
    for seed in range(rounds):
        parts, first = [], 0
        for n in sizes:  # as previews.candidates records them: a uniform sample of the part's own images
            picks = rng.choice(n, size=min(shown, n), replace=False)
            parts.append({"0": {"count": n, "samples": [[f"s{first + j}", 0, 1] for j in picks]}})
            first += n
        (count, where), = from_candidates(parts, ["only"], seed)
        names = [rel for rel, _ in where]
        assert count == sum(sizes) and len(names) == shown == len(set(names))
        seen[[int(x[1:]) for x in names]] += 1
    # each image shown in 9/24 of the rounds: 1125 of 3000, binomial sd 26.5; 5 sd of margin
    assert np.all(np.abs(seen - rounds * shown / sum(sizes)) < 135), seen


def test_merge_refuses_preview_candidates_outside_the_parts_shards(tmp_path, folder):
    """A part manifest is input (in a bucket, anyone with write access made it): a preview sample that points
    outside that part's own shards is refused with the part named, never read."""
    from fastpipe.convert.merge import merge_parts
    from fastpipe.dataset.manifest import ManifestError

    out = tmp_path / "o"
    for i in range(2):
        shard(cfg(folder, out, parts=2, part=i))
    part = out / "dataset.part-001-of-002.json"
    d = json.loads(part.read_text())
    d["outputs"]["preview_candidates"]["0"]["samples"][0][0] = "../../etc/passwd"
    part.write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=r"part 1: outputs\.preview_candidates is damaged"):
        merge_parts(out)
    assert not (out / "dataset.json").exists()


def test_merge_refuses_parts_that_saw_different_files(tmp_path, folder):
    """Each part plans the whole job from what it sees in SRC; a node whose copy differs (a photo changed) would
    cut the samples differently, so the merge refuses rather than leaving samples out or in twice."""
    from fastpipe.convert.merge import merge_parts
    from fastpipe.dataset.manifest import ManifestError

    other = shutil.copytree(folder, tmp_path / "node-2")
    victim = sorted(p for p in other.rglob("*.jpg"))[0]
    victim.write_bytes(victim.read_bytes() + b"\0")  # other bytes, still a decodable JPEG
    shard(cfg(folder, tmp_path / "o", parts=2, part=0))
    shard(cfg(other, tmp_path / "o", parts=2, part=1))
    with pytest.raises(ManifestError, match=r"different settings, class lists or source files"):
        merge_parts(tmp_path / "o")


def test_parts_written_before_the_plan_hash_still_compare_the_source_path(tmp_path, folder):
    """Part manifests without `settings.plan` (written by an earlier fastpipe) have nothing else to show they saw
    the same files: parts from two SRC paths are refused, as they were; from one path they merge."""
    from fastpipe.convert.merge import merge_parts
    from fastpipe.dataset.manifest import ManifestError

    other = shutil.copytree(folder, tmp_path / "node-2")
    for out, second in ((tmp_path / "two", other), (tmp_path / "one", folder)):
        shard(cfg(folder, out, parts=2, part=0))
        shard(cfg(second, out, parts=2, part=1))
        for part in out.glob("dataset.part-*.json"):
            doc = json.loads(part.read_text())
            del doc["settings"]["plan"]
            part.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=r"different settings, class lists or source files"):
        merge_parts(tmp_path / "two")
    parts = [json.loads(p.read_text()) for p in (tmp_path / "one").glob("dataset.part-*.json")]
    merged = merge_parts(tmp_path / "one")
    assert merged.splits["train"].samples == sum(sum(p["splits"]["train"]["class_counts"]) for p in parts) > 0


def test_an_output_written_before_the_source_path_left_the_fingerprint_is_up_to_date(tmp_path, folder,
                                                                                     monkeypatch):
    """Its dataset.json holds the fingerprint computed with SRC's path: the same command finds it complete
    instead of refusing it as another conversion."""
    from fastpipe.convert import plan

    seen, real = [], plan.fingerprints
    monkeypatch.setattr(plan, "fingerprints", lambda *a: seen.append(real(*a)) or seen[-1])
    shard(cfg(folder, tmp_path / "o"))
    doc = json.loads((tmp_path / "o" / "dataset.json").read_text())
    assert doc["settings"]["fingerprint"] == seen[0][0] != seen[0][1]
    doc["settings"]["fingerprint"] = seen[0][1]  # as the earlier version wrote it
    (tmp_path / "o" / "dataset.json").write_text(json.dumps(doc))
    assert shard(cfg(folder, tmp_path / "o")).up_to_date


def test_merge_refuses_missing_parts(tmp_path, folder):
    from fastpipe.convert.merge import merge_parts
    from fastpipe.dataset.manifest import ManifestError

    shard(cfg(folder, tmp_path / "o", parts=2, part=1))
    with pytest.raises(ManifestError, match=r"parts \[0\] of 2"):
        merge_parts(tmp_path / "o")


def test_index_adopts_webdataset_shardwriter_output(tmp_path):
    out = tmp_path / "foreign"
    out.mkdir()
    with wds.ShardWriter(str(out / "part-%03d.tar"), maxcount=7) as sink:
        for i in range(20):
            label = i % 3
            sink.write({"__key__": f"s{i:04d}", "jpg": photo(list(COLORS.values())[label], seed=i),
                        "cls": str(label).encode()})
    from fastpipe.convert.foreign import IndexConfig, index_shards

    shards = sorted(out.glob("part-*.tar"))
    names = tmp_path / "classes.txt"
    names.write_text("red\ngreen\nblue\n")
    m = index_shards(IndexConfig(shards[:2], None, shards[2:], str(names), 100))
    assert m.classes == ("red", "green", "blue") and m.components.label == "cls"
    assert m.splits["train"].samples == 14 and m.splits["val"].samples == 6
    assert m.mean[0] > m.mean[2]
    for s in m.splits["train"].shards:
        assert len(read_index(out / s.index)) == s.samples
    report = inspect(out, verify=True)
    assert report.ok, report.problems
    check_readers(out)


def test_index_keeps_a_timm_info_file_the_user_wrote(tmp_path):
    from fastpipe.convert.foreign import IndexConfig, index_shards

    out = tmp_path / "foreign"
    tars = _foreign_set(out)
    (out / "_info.json").write_text('{"splits": {}}')
    with pytest.warns(UserWarning, match="_info.json was not written by fastpipe: kept"):
        m = index_shards(IndexConfig(tars))
    assert (out / "_info.json").read_text() == '{"splits": {}}' and m.outputs["readers"] == ["wids-train.json"]
    assert json.loads((out / "wids-train.json").read_text())["shardlist"][0]["url"] == "part-000.tar"


# -- the shard layout and the files other readers need ------------------------------------------------------
def test_each_split_is_cut_into_eight_shards_unless_the_shard_size_is_given(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 20, "green": 12, "blue": 8})
    summary = shard(cfg(src, tmp_path / "auto", val_fraction=0.25))
    m = load(tmp_path / "auto")
    for name, n in (("train", 30), ("val", 10)):
        counts = [s.samples for s in m.splits[name].shards]
        assert len(counts) == 8 and sum(counts) == n and max(counts) - min(counts) <= 1
    assert "shards: train 8, val 8 (each split cut into at least 8 (--min-shards)" in "\n".join(summary.lines())
    check_readers(tmp_path / "auto")
    fixed = shard(cfg(src, tmp_path / "fixed", val_fraction=0.25, max_shard_size=1024**2))
    assert [len(sp.shards) for sp in load(tmp_path / "fixed").splits.values()] == [1, 1]
    text = "\n".join(fixed.lines())
    assert "shards: train 1, val 1 (up to 1MB each (--max-shard-size))" in text and "--min-shards 8 cuts" in text
    both = shard(cfg(src, tmp_path / "both", val_fraction=0.25, max_shard_size=1024**2, min_shards=3))
    assert [len(sp.shards) for sp in load(tmp_path / "both").splits.values()] == [3, 3]
    assert not any("--min-shards 8 cuts" in n for n in both.notes)


def test_parts_of_the_default_layout_merge_into_at_least_eight_shards_per_split(tmp_path):
    src = make_folder(tmp_path / "src", {"red": 20, "green": 12, "blue": 8})
    out = tmp_path / "parts"
    for i in range(3):
        shard(cfg(src, out, parts=3, part=i, val_fraction=0.25))
    assert not any((out / n).exists() for n in READERS)  # a part is not a data set: the merge writes them
    from fastpipe.convert.merge import merge_parts

    merged = merge_parts(out)
    assert [len(sp.shards) >= 8 for sp in merged.splits.values()] == [True, True]
    check_readers(out)
    (out / "wids-val.json").write_text("edited")  # a rerun of the merge rewrites its own files
    merge_parts(out)
    check_readers(out)


def test_reader_files_are_fastpipes_to_replace_and_a_users_stops_the_run(folder, tmp_path):
    out = tmp_path / "out"
    shard(cfg(folder, out, val_fraction=0.25))
    check_readers(out)
    shard(cfg(folder, out, val_fraction=0.5, overwrite=True))  # other settings: other shards, the files follow
    check_readers(out)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "wids-train.json").write_text("the user's")
    with pytest.raises(ConfigError, match=r"did not write but would overwrite \(wids-train\.json\)"):
        shard(cfg(folder, mine, overwrite=True))
    assert (mine / "wids-train.json").read_text() == "the user's"


def test_inspect_verify_finds_a_damaged_shard(tmp_path, folder):
    out = tmp_path / "out"
    shard(cfg(folder, out))
    assert inspect(out, verify=True).ok
    first = sorted(out.glob("train-*.tar"))[0]
    data = bytearray(first.read_bytes())
    data[700:900] = b"\0" * 200
    first.write_bytes(bytes(data))
    report = inspect(out, verify=True)
    assert not report.ok and report.altered and any("checksum differs" in line for line in report.lines)


def test_cli_help_and_clear_errors(tmp_path):
    from fastpipe.cli import main
    from fastpipe.errors import ConfigError
    from fastpipe.options import parse_gb, parse_size

    for cmd in ("shard", "demo-data", "index", "inspect", "merge", "doctor", "train", "memory", "bench", "runs"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    r = subprocess.run([sys.executable, "-m", "fastpipe", "shard", str(tmp_path / "nope"), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert parse_size("256MB") == 256 * 2**20 and parse_size("64k") == 65536 and parse_size("1000B") == 1000
    with pytest.raises(ConfigError, match="give the unit"):
        parse_size("1000")  # a bare number is ambiguous for a size
    assert parse_gb("8") == 8 * 2**30 and parse_gb("512MB") == 512 * 2**20  # GPU memory: a bare number is GB


def test_demo_data_is_deterministic_and_dirty(tmp_path):
    from fastpipe.convert.demo import DemoConfig, make_demo_data

    kw = dict(count=14, width=320, height=240, workers=1)
    make_demo_data(DemoConfig(tmp_path / "a", **kw))
    make_demo_data(DemoConfig(tmp_path / "b", **kw))
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    summary = shard(cfg(tmp_path / "a", tmp_path / "out"))
    assert Counter(summary.rejected) == Counter({"truncated": 1, "duplicate": 1, "not-an-image": 1})
    (copy,) = [r for r in rejected(tmp_path / "out") if r["reason"] == "duplicate"]
    assert copy["path"].split("/")[1].startswith("copy_of_"), copy  # the copy is refused, the original kept


@pytest.mark.parametrize("names,kept", [(["IMG_HE0005 (1).jpg", "IMG_HE0005.jpg"], "IMG_HE0005.jpg"),
                                        (["copy_of_x.jpg", "x (1).jpg", "x.jpg"], "x.jpg"),
                                        (["img_10.jpg", "img_9a.jpg"], "img_9a.jpg")])
def test_duplicates_keep_the_original_whatever_the_order(names, kept):
    """'healthy/IMG_HE0005.jpg' was refused as a duplicate of 'healthy/IMG_HE0005 (1).jpg'."""
    from fastpipe.convert.plan import deduplicate
    from fastpipe.convert.sources import Item

    items = [Item(f"healthy/{n}", "healthy", None) for n in names]
    hashes = {i.path: "same bytes" for i in items}
    for order in (items, items[::-1]):  # as another machine or part of a cluster job may list them
        keep, dropped = deduplicate(list(order), hashes)
        assert [i.path for i in keep] == [f"healthy/{kept}"]
        assert all(r.reason == "duplicate" and r.detail == f"same bytes as healthy/{kept}" for r in dropped)


def test_doctor_runs_and_reports(capsys):
    from fastpipe.doctor import run_doctor

    assert run_doctor() == 0  # nothing on a CPU-only machine is broken
    out = capsys.readouterr().out
    assert "torch build" in out and "Pillow" in out and "CPU cores" in out
    if "nvidia-smi not found" in out:  # a machine without a GPU is told one thing, not 'install the driver' too
        assert "install the driver" not in out and "no GPU on this machine" in out
    import torch

    if "nvidia-smi not found" in out and torch.version.cuda:  # a CUDA build where it serves nothing: said, with the fix
        assert "is not needed here: scripts/setup.sh installs the CPU build" in out, out


def test_doctor_gives_optional_suggestions_as_info_not_warnings(capsys):
    """A fresh, complete install showed a WARN for pillow-simd, an optional package."""
    from fastpipe.doctor import check_pillow, run_doctor

    pillow = check_pillow()[0]
    assert pillow.status == ("OK" if "simd" in pillow.found else "INFO")
    run_doctor()
    out = capsys.readouterr().out
    for optional in ("Pillow", "DALI", "torch build"):  # pillow-simd; DALI; the CPU build where there is no GPU
        assert f"[WARN] {optional} " not in out, out
    if pillow.status == "INFO":
        assert "tip: optional: scripts/setup.sh --pillow-simd" in out, out


def test_missing_or_damaged_manifest_says_what_to_run(tmp_path):
    from fastpipe.dataset.manifest import ManifestError

    with pytest.raises(ManifestError, match="fastpipe shard"):
        load(tmp_path)
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(ManifestError, match="damaged"):
        load(tmp_path)
    r = subprocess.run([sys.executable, "-m", "fastpipe", "inspect", str(tmp_path / "nowhere")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "fastpipe shard" in r.stderr and "Traceback" not in r.stderr


def test_index_refuses_text_labels_with_the_fix(tmp_path):
    from fastpipe.convert.foreign import IndexConfig, index_shards

    with wds.TarWriter(str(tmp_path / "t.tar")) as sink:
        sink.write({"__key__": "a", "jpg": photo(COLORS["red"]), "cls": b"red"})
    with pytest.raises(ValueError, match="not an integer class index"):
        index_shards(IndexConfig([tmp_path / "t.tar"]))


def test_the_summary_counts_what_was_written_and_what_changed_colour(tmp_path):
    """'94 images converted' when 92 were written; grey and transparent photos converted to RGB without a word."""
    src = make_folder(tmp_path / "src", {"red": 4, "green": 4})
    (src / "red" / "grey.png").write_bytes(photo(COLORS["red"], fmt="PNG", mode="L"))
    (src / "red" / "alpha.png").write_bytes(photo(COLORS["red"], fmt="PNG", mode="RGBA"))
    (src / "green" / "cut.jpg").write_bytes(photo(COLORS["green"])[:300])  # truncated: rejected while converting
    text = "\n".join(shard(cfg(src, tmp_path / "out", val_fraction=0)).lines())
    assert "11 images processed" in text and "10 written, 1 rejected while converting" in text, text
    assert "converted to RGB: 1 grayscale, 1 with transparency (flattened onto white)" in text, text


def test_a_resumed_conversion_says_its_colour_counts_are_this_runs():
    """A resumed conversion said 'converted to RGB: 1 grayscale' of its own images only, as if of the data set."""
    from fastpipe.convert.summary import Summary

    fresh = Summary(Path("out"), converted_now=8, written_now=8, modes=Counter({"L": 1}), seconds=1.0)
    resumed = Summary(Path("out"), converted_now=8, written_now=8, modes=Counter({"L": 1}), seconds=1.0, resumed=16)
    assert "converted to RGB: 1 grayscale" in fresh.lines()
    assert "converted to RGB in this run: 1 grayscale" in resumed.lines()


def test_index_refuses_an_empty_tar_before_writing_anything(tmp_path):
    """It wrote a manifest listing a shard of no samples, which every loader then refused."""
    from fastpipe.convert.foreign import IndexConfig, index_shards

    with wds.TarWriter(str(tmp_path / "good.tar")) as sink:
        sink.write({"__key__": "a", "jpg": photo(COLORS["red"]), "cls": b"0"})
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    with pytest.raises(DataError, match=r"empty\.tar holds no samples"):
        index_shards(IndexConfig([tmp_path / "good.tar", tmp_path / "empty.tar"]))
    assert not (tmp_path / "dataset.json").exists()


# -- data safety ------------------------------------------------------------------------------------------
def test_overwrite_removes_only_what_fastpipe_wrote(folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.tar").write_bytes(b"the user's own archive")
    (out / "backup.idx").write_text("not ours")
    shard(cfg(folder, out))
    shard(cfg(folder, out, quality=70, overwrite=True))
    assert (out / "notes.tar").read_bytes() == b"the user's own archive" and (out / "backup.idx").exists()


def test_files_fastpipe_would_overwrite_but_did_not_write_stop_the_run(folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-000000.tar").write_bytes(b"someone else's shard")
    with pytest.raises(ConfigError, match=r"did not write but would overwrite \(train-000000\.tar\)"):
        shard(cfg(folder, out, overwrite=True))
    assert (out / "train-000000.tar").read_bytes() == b"someone else's shard"


def _foreign_set(folder: Path) -> list[Path]:
    folder.mkdir()
    with wds.ShardWriter(str(folder / "part-%03d.tar"), maxcount=5) as sink:
        for i in range(10):
            sink.write({"__key__": f"s{i:04d}", "jpg": photo(COLORS["red"], seed=i), "cls": str(i % 2).encode()})
    return sorted(folder.glob("part-*.tar"))


def test_shard_into_an_adopted_folder_needs_overwrite_and_keeps_the_users_tars(folder, tmp_path):
    from fastpipe.convert.foreign import IndexConfig, index_shards

    out = tmp_path / "adopted"
    tars = _foreign_set(out)
    index_shards(IndexConfig(tars))
    before = {p.name: p.read_bytes() for p in tars}
    with pytest.raises(ConvertError, match="adopted shards"):
        shard(cfg(folder, out))
    shard(cfg(folder, out, overwrite=True))
    assert {p.name: p.read_bytes() for p in tars} == before  # the user's shards survive --overwrite
    assert sum(sp.samples for sp in load(out).splits.values()) == 24


def test_index_never_replaces_a_conversion_and_idx_only_repairs_in_place(folder, tmp_path):
    from fastpipe.cli import main

    out = tmp_path / "out"
    shard(cfg(folder, out))
    manifest_bytes = (out / "dataset.json").read_bytes()
    victim = out / "val-000000.idx"
    victim.unlink()
    with pytest.raises(Exception, match=r"fastpipe index --idx-only .*val-000000\.tar") as e:
        from fastpipe import make_loader

        make_loader(out, "torch", split="val", batch_size=2, image_size=32, device="cpu", num_workers=0)
    assert "dataset.json stays" in str(e.value)
    assert main(["index", str(out / "val-000000.tar")]) == 2  # would replace the conversion's manifest: refused
    assert main(["index", "--idx-only", str(out / "val-000000.tar")]) == 0
    assert (out / "dataset.json").read_bytes() == manifest_bytes and victim.exists()
    assert inspect(out, verify=True).ok


def test_a_second_writer_is_refused_with_who_holds_the_folder(folder, tmp_path):
    from fastpipe.util import FolderLock

    out = tmp_path / "out"
    with FolderLock(out, "fastpipe shard (test)"):
        r = subprocess.run([sys.executable, "-m", "fastpipe", "shard", str(folder), str(out)], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2 and "is being written by pid" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "dataset.json").exists()
    shard(cfg(folder, out))  # released: the next run goes ahead


def test_a_run_stopped_while_writing_previews_is_finished_by_the_rerun(folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "previews").write_text("a file where the previews folder goes: drawing them fails")
    with pytest.raises(OSError):
        shard(cfg(folder, out))
    assert not (out / "dataset.json").exists()  # not declared complete
    (out / "previews").unlink()
    again = shard(cfg(folder, out))
    assert not again.up_to_date and again.converted_now == 0  # the shards were kept, only the rest is done
    assert len(list((out / "previews").iterdir())) == 3 and load(out).outputs["previews"]


def test_preview_names_never_collide_or_escape(tmp_path):
    labels = ["a b", "a/b", "a_b", "猫", "犬", "..", "x" * 300, "CON"]
    rows = ["path,label"]
    for i, label in enumerate(labels):
        for j in range(2):
            name = f"img_{i}_{j}.jpg"
            (tmp_path / name).write_bytes(photo(COLORS["red"], seed=10 * i + j))
            rows.append(f'{name},"{label}"')
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    shard(cfg(tmp_path / "list.csv", out, val_fraction=0))
    files = load(out).outputs["previews"]
    assert len(set(files.values())) == len(labels) and set(files) == set(labels)
    for f in files.values():
        p = (out / f).resolve()
        assert p.parent == (out / "previews").resolve() and p.is_file() and len(p.name) < 100


def test_preview_tiles_are_apart(tmp_path):
    """Photos that fill their cell touched their neighbours: the sheet read as one picture."""
    from PIL import Image

    from fastpipe.convert.previews import CELL, TITLE, draw

    white = photo((250, 250, 250), size=(CELL, CELL))
    draw([(4, [("s", (0, 0))] * 4)], ["c"], tmp_path, lambda locations: [white] * len(locations), per_class=4)
    sheet = np.asarray(Image.open(tmp_path / "c.jpg").convert("L")).astype(int)
    across = sheet[TITLE + CELL // 2] > 128  # a line through the first row of tiles: light on the tiles
    down = sheet[TITLE:, CELL // 2] > 128
    for line in (across, down):  # 2 x 2 tiles: one dark gap between the light, along and across
        gaps = np.diff(np.flatnonzero(line)) - 1
        dark = gaps[gaps > 0]
        assert len(dark) == 1 and dark[0] >= 3, dark


def test_conversion_pool_forks_only_where_that_is_safe(monkeypatch):
    """fork (fast; no re-import of the caller's main module) unless a DALI pipeline or a CUDA context lives here."""
    import sys

    from fastpipe.util import pool_context as _pool_context

    monkeypatch.delitem(sys.modules, "nvidia.dali", raising=False)
    assert _pool_context().get_start_method() == "fork"
    monkeypatch.setitem(sys.modules, "nvidia.dali", object())
    assert _pool_context().get_start_method() == "spawn"


def test_building_the_cli_imports_no_torch():
    """`fastpipe shard` and `demo-data` need no torch: importing it cost every command seconds (and, in spawned
    conversion workers, every worker)."""
    import subprocess
    import sys

    code = "import sys, fastpipe.cli as c; c.build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr[-1000:]


def test_ray_without_ray_installed_says_how_to_install_it(folder, tmp_path, monkeypatch, capsys):
    """`--ray` (or `--ray-address`) where Ray is missing: one line with the install command, before anything is
    read or written."""
    import importlib.util

    from fastpipe.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    for flag in (["--ray"], ["--ray-address", "10.0.0.1:6379"]):
        assert main(["shard", str(folder), str(tmp_path / "out"), *flag]) == 2
        err = capsys.readouterr().err
        assert "--ray needs Ray here and on every node" in err and "pip install 'fastpipe[ray]'" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_photo_replaced_after_it_was_hashed_is_rejected_as_changed(tmp_path, monkeypatch, workers):
    """The plan is made from each photo's hash; a photo replaced after hashing (here right after plan.hash_files
    returns, before any is converted: no race) is rejected as `changed`, naming it, not converted as it now is:
    red/img_001 replaced by a copy of red/img_002 would be a duplicate the plan never saw, and red/img_003 replaced
    by a blue photo would be written as red. With --on-change stop the run stops at the first, naming it."""
    from fastpipe.convert import plan

    src = make_folder(tmp_path / "src", {"red": 6, "blue": 4})
    hash_files = plan.hash_files

    def hashed_then_replaced(*args, **kw):
        found = hash_files(*args, **kw)
        (src / "red" / "img_001.jpg").write_bytes((src / "red" / "img_002.jpg").read_bytes())
        (src / "red" / "img_003.jpg").write_bytes((src / "blue" / "img_000.jpg").read_bytes())
        return found

    monkeypatch.setattr(plan, "hash_files", hashed_then_replaced)
    summary = shard(cfg(src, tmp_path / "out", short_side=32, val_fraction=0.25, workers=workers))
    changed = {r["path"]: r["detail"] for r in rejected(tmp_path / "out") if r["reason"] == "changed"}
    assert sorted(changed) == ["red/img_001.jpg", "red/img_003.jpg"]
    assert "its bytes changed after they were hashed for the plan" in changed["red/img_001.jpg"]
    assert sum(summary.written.values()) == 8 and summary.rejected == Counter({"changed": 2})
    jpegs, paths = [], []
    for tar in sorted((tmp_path / "out").glob("*.tar")):
        with tarfile.open(tar) as t:
            for member in t.getmembers():
                data = t.extractfile(member).read()
                if member.name.endswith(".jpg"):
                    jpegs.append(data)
                elif member.name.endswith(".json"):
                    paths.append(json.loads(data)["path"])
    assert len(paths) == 8 and not {"red/img_001.jpg", "red/img_003.jpg"} & set(paths)
    assert len(set(jpegs)) == len(jpegs)  # no photo twice
    make_folder(src, {"red": 6, "blue": 4})  # as it was
    with pytest.raises(DataError, match=r"red/img_00[13]\.jpg: its bytes changed .*--on-change stop"):
        shard(cfg(src, tmp_path / "stop", short_side=32, val_fraction=0.25, workers=workers, on_change="stop"))

"""Data sets in object storage, read through real servers on loopback: an HTTP server with Range support
(fastpipe.testing.devserver) and moto's S3-protocol server, both with injected faults (503s, reset connections, stalls).
Every backend must read every sample by URL with the right labels, nothing lost or repeated; the node cache must
fetch each byte once across workers, evict under its limit and repair a damaged cached shard."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import aws_env, epoch, make_folder
from test_loaders import REAL_MODES

from fastpipe.dataset.loading import load
from fastpipe.errors import ConfigError, DataError
from fastpipe.loaders import make_loader
from fastpipe.store.remote import Remote, RemoteError
from fastpipe.testing.devserver import Faults, FolderServer

KW = dict(batch_size=8, image_size=32, device="cpu", with_keys=True)


pytestmark = pytest.mark.usefixtures("quick_retries")


def disk_use(folder) -> int:
    return sum(os.stat(os.path.join(folder, f)).st_blocks * 512 for f in os.listdir(folder) if f.endswith(".shard"))


@pytest.mark.parametrize("backend,threads", REAL_MODES)
@pytest.mark.parametrize("split", ["train", "val"])
def test_every_backend_reads_every_sample_by_url_under_faults(converted, tmp_path, backend, threads, split):
    local = epoch(make_loader(converted, backend, split=split, num_workers=0, **KW))
    faults = Faults(error_every=3, reset_every=4, only=".tar")
    with FolderServer(converted, faults) as url:
        loader = make_loader(url, backend, split=split, num_workers=2, threads=threads, cache_dir=tmp_path / "cache",
                             **KW)
        remote = epoch(loader)
    assert faults.errors and faults.resets  # the faults were met ...
    assert remote[:2] == local[:2]  # ... and the epoch is the same samples, in the same order, with their labels
    if split == "val":
        assert len(set(remote[0])) == load(converted).split("val").samples  # every sample once
        assert torch.equal(remote[2], local[2])
    assert loader.stats.retries >= 1 and loader.stats.requests >= 1


def test_s3_protocol_server_with_faults(converted, tmp_path, s3_bucket):
    """moto's S3 server behind a proxy that injects 503 SlowDown, resets and stalls longer than the timeout."""
    endpoint, opts = s3_bucket
    local = epoch(make_loader(converted, split="train", num_workers=2, **KW))
    faults = Faults(error_every=4, reset_every=5, stall_every=7, stall=3.0, only=".tar")
    with FolderServer(None, faults, proxy_to=endpoint) as proxy:
        options = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy}}
        loader = make_loader("s3://leafs/sets/v1", split="train", num_workers=2, storage_options=options,
                             cache_dir=tmp_path / "cache", **KW)
        remote = epoch(loader)
    assert faults.errors and faults.resets and faults.stalls
    assert remote[:2] == local[:2] and torch.equal(remote[2], local[2])


@pytest.mark.parametrize("threads", [False, True])
def test_workers_share_the_cache_and_fetch_each_byte_once(converted, tmp_path, threads):
    m = load(converted)
    shard_bytes = sum(s.bytes for s in m.split("val").shards)
    with FolderServer(converted) as url:
        first = make_loader(url, split="val", num_workers=2, threads=threads, cache_dir=tmp_path / "c", **KW)
        epoch(first)
        again = make_loader(url, split="val", num_workers=2, threads=threads, cache_dir=tmp_path / "c", **KW)
        epoch(again)
    assert first.stats.fetched_bytes == shard_bytes  # every byte of the split once, across both workers
    assert first.stats.requests < m.split("val").samples / 2  # coalesced: never a request per sample
    assert again.stats.requests == 0  # the second run reads the cache only
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(
        f"{s.sha256}.{ext}" for s in m.split("val").shards for ext in ("shard", "ok", "idx"))


def test_a_restarted_job_asks_the_store_for_dataset_json_only(converted, tmp_path):
    """A preempted job starting again on the same node: the shards' indexes come from the cache too (a data set
    of thousands of shards would otherwise fetch thousands of `.idx` files at every start)."""
    faults = Faults()
    with FolderServer(converted, faults) as url:
        first = epoch(make_loader(url, split="train", num_workers=2, cache_dir=tmp_path / "c", **KW))
        before = faults.requests
        loader = make_loader(url, split="train", num_workers=2, cache_dir=tmp_path / "c", **KW)
        asked = faults.requests - before
        again = epoch(loader)
    assert asked == 1  # dataset.json: it says whether the data set changed
    assert again[:2] == first[:2] and torch.equal(again[2], first[2])


def test_a_damaged_cached_index_is_fetched_again(converted, tmp_path):
    m = load(converted)
    local = epoch(make_loader(converted, split="val", num_workers=0, **KW))
    with FolderServer(converted) as url:
        make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c", **KW)
        copies = sorted((tmp_path / "c").glob("*.idx"))
        assert len(copies) == len(m.split("val").shards)
        copies[0].write_bytes(copies[0].read_bytes()[:-40])  # cut short, as by a crash while it was written
        copies[-1].write_bytes(b"")
        remote = epoch(make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c", **KW))
    assert remote[:2] == local[:2]
    idx = {s.sha256: (converted / s.index).read_bytes() for s in m.split("val").shards}
    assert all(p.read_bytes() == idx[p.stem] for p in copies)  # repaired


def test_a_cached_sample_that_does_not_decode_is_fetched_again_before_it_is_called_bad(converted, tmp_path):
    """A presence byte set without its bytes (a crash, a disk error, a bad hand): the sample's cached copy is
    zeros. It was skipped as undecodable, blaming the data; now it is fetched once more and decodes."""
    m = load(converted)
    shard = m.split("val").shards[0]
    local = epoch(make_loader(converted, split="val", num_workers=0, **KW))
    cache = tmp_path / "c"
    cache.mkdir(mode=0o700)
    damaged = bytearray(shard.bytes + shard.samples)  # no bytes; the first two samples claimed present
    damaged[shard.bytes : shard.bytes + 2] = b"\1\1"
    (cache / f"{shard.sha256}.shard").write_bytes(bytes(damaged))
    with FolderServer(converted) as url, warnings.catch_warnings():
        warnings.simplefilter("error")  # no sample skipped
        loader = make_loader(url, split="val", num_workers=0, cache_dir=cache, **KW)
        remote = epoch(loader)
    assert remote[:2] == local[:2] and torch.equal(remote[2], local[2]) and loader.stats.skipped == 0


def test_only_the_needed_part_of_a_shard_is_fetched(converted, tmp_path):
    """One rank of four reads about a quarter of the val split's bytes, not whole shards."""
    total = sum(s.bytes for s in load(converted).split("val").shards)
    with FolderServer(converted) as url:
        loader = make_loader(url, split="val", num_workers=0, rank=0, world_size=4, cache_dir=tmp_path / "c", **KW)
        epoch(loader)
    assert 0 < loader.stats.fetched_bytes < 0.6 * total


@pytest.mark.parametrize("workers", [0, 2])
def test_cache_evicts_least_recently_used_shards_under_its_limit(converted, tmp_path, workers):
    """Also with worker threads, which share the node cache in one process: each reads a batch through the map its
    samples were fetched into, whatever another thread's fetch evicts meanwhile."""
    m = load(converted)
    largest = max(s.bytes for s in m.split("train").shards)
    limit = 2 * largest + 8192
    local = epoch(make_loader(converted, split="train", num_workers=0, **KW))
    with FolderServer(converted) as url:
        loader = make_loader(url, split="train", num_workers=workers, threads=True, cache_dir=tmp_path / "c",
                             cache_limit=limit, **KW)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one window may span more than the limit: said once, not an error
            remote = epoch(loader)
    assert remote[:2] == local[:2]  # eviction under the reader's feet loses nothing
    window = 4 * 2 * largest  # the shards of the fetch in progress are kept (prefetch.FETCH_WINDOW batches)
    assert disk_use(tmp_path / "c") <= max(limit, window)
    cached = {p.stem for p in (tmp_path / "c").glob("*.shard")}
    assert {p.stem for p in (tmp_path / "c").glob("*.idx")} <= cached  # an index goes with its shard
    assert loader.stats.fetched_bytes > sum(s.bytes for s in m.split("train").shards)  # it did evict and refetch


def test_a_batch_read_before_its_shard_was_fetched_again_keeps_its_maps(converted, tmp_path):
    """The thread that opens batches reads the next one (fetching, maybe evicting and fetching a shard again into a
    new file) while other threads still decode the last: the last batch's samples are still read through the maps
    they were read in."""
    from fastpipe.loaders.shards import ShardSet
    from fastpipe.loaders.threads import _own_shards

    largest = max(s.bytes for s in load(converted).split("train").shards)
    with FolderServer(converted) as url:
        loader = make_loader(url, split="train", num_workers=2, threads=True, cache_dir=tmp_path / "c",
                             cache_limit=largest + 8192, **KW)  # room for one shard
        reader = _own_shards(loader.dataset).shards
        first = np.arange(reader.starts[0], reader.starts[1])
        got = reader.read(first[: len(first) // 2])
        reader.read(np.arange(reader.starts[1], reader.starts[2]))  # evicts the first shard
        reader.read(first[len(first) // 2 :])  # and fetches it again, into a new file
        assert reader._views[0] is not got.views[0]
    local = ShardSet(load(converted), "train").read(first[: len(first) // 2])
    assert [bytes(x) for x in got.images] == [bytes(x) for x in local.images]


def test_a_loader_thread_reads_its_batch_through_its_own_maps(converted, tmp_path, monkeypatch):
    """Worker threads share the node cache: another thread's fetch may evict a shard and fetch it again into a new
    file, without this thread's samples, while this thread reads a batch of it. Played in that order (the other
    thread's fetches run inside this one's read): the batch's bytes and labels are still its own, read through the
    map its samples were made present in."""
    from fastpipe.loaders.shards import ShardSet
    from fastpipe.loaders.threads import _own_shards

    largest = max(s.bytes for s in load(converted).split("train").shards)
    with FolderServer(converted) as url:
        loader = make_loader(url, split="train", num_workers=2, threads=True, cache_dir=tmp_path / "c",
                             cache_limit=largest + 8192, **KW)  # room for one shard
        mine, other = _own_shards(loader.dataset).shards, _own_shards(loader.dataset).shards
        first = np.arange(mine.starts[0], mine.starts[1])
        read, meanwhile = ShardSet._view, []

        def other_thread_meanwhile(self, shard, offset, size):
            if self is mine and not meanwhile:
                meanwhile.append(1)
                other.fetch(np.arange(mine.starts[1], mine.starts[2]))  # evicts the first shard
                other.fetch(first[len(first) // 2 :])  # and makes it again, a new file without this batch
            return read(self, shard, offset, size)

        monkeypatch.setattr(ShardSet, "_view", other_thread_meanwhile)
        got = mine.read(first[: len(first) // 2])
    monkeypatch.undo()
    local = ShardSet(load(converted), "train").read(first[: len(first) // 2])
    assert meanwhile and loader.shards.cache.path(0).exists()  # the shard was fetched again into a new file
    assert [bytes(x) for x in got.images] == [bytes(x) for x in local.images]
    assert np.array_equal(got.labels, local.labels)


def test_a_cache_limit_smaller_than_one_fetch_warns_and_loses_nothing(converted, tmp_path):
    """A limit below one shard: every fetch overflows it. The loader says so once, with what to do, and still
    reads every sample right, epoch after epoch (each refetched)."""
    largest = max(s.bytes for s in load(converted).split("train").shards)
    local = epoch(make_loader(converted, split="train", num_workers=0, **KW))
    with FolderServer(converted) as url:
        loader = make_loader(url, split="train", num_workers=0, cache_dir=tmp_path / "c", cache_limit=largest // 2,
                             **KW)
        with pytest.warns(UserWarning, match=r"over its limit of .* MB: raise cache_limit") as said:
            first = epoch(loader)
            second = epoch(loader)
    assert first[:2] == local[:2] and second[:2] == local[:2]
    assert len([w for w in said if "cache_limit" in str(w.message)]) == 1


def test_damaged_cached_shard_is_fetched_again(converted, tmp_path):
    with FolderServer(converted) as url:
        good = epoch(make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c", **KW))
        victim = next((tmp_path / "c").glob("*.shard"))
        with open(victim, "r+b") as f:  # flip bytes in the middle of the shard's data
            f.seek(victim.stat().st_size // 2)
            f.write(b"\xff" * 256)
        with pytest.warns(UserWarning, match="damaged; it is fetched again"):
            loader = make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c", **KW)
        again = epoch(loader)
    assert again[:2] == good[:2] and torch.equal(again[2], good[2])
    assert loader.stats.fetched_bytes > 0


def test_a_remote_split_with_fewer_batches_than_workers_reads_whole(converted, tmp_path):
    """A small split read by more workers than it has batches: the idle worker ends its share quietly (it failed
    with numpy's 'need at least one array to concatenate')."""
    m = load(converted)
    batches = -(-m.split("val").samples // KW["batch_size"])
    local = epoch(make_loader(converted, split="val", num_workers=0, **KW))
    with FolderServer(converted) as url:
        remote = epoch(make_loader(url, split="val", num_workers=batches + 1, cache_dir=tmp_path / "c", **KW))
    assert remote[:2] == local[:2]


def test_fetch_windows_grow_while_decoding_waits_for_them(converted, tmp_path, monkeypatch):
    """A store slower to answer than decoding is to use up a window: windows double (fewer, larger fetches, a
    round trip each), up to MAX_WINDOW batches, MAX_WINDOW_BYTES, or what a cache limit leaves room for; every
    batch still comes, in order."""
    from fastpipe.loaders import prefetch as stream
    from fastpipe.loaders.shards import ShardSet

    with FolderServer(converted, Faults(latency=0.05)) as url:
        fetches = {}
        for limit in (None, 1, "bytes"):
            if limit == "bytes":
                monkeypatch.setattr(stream, "MAX_WINDOW_BYTES", 1)
            shards = ShardSet(load(url, cache_dir=tmp_path / f"c{limit}",
                                   cache_limit=limit if limit != "bytes" else None), "train")
            sizes, fetch = [], shards.fetch

            def counted(ids, *a, sizes=sizes, fetch=fetch, **k):
                sizes.append(len(ids))
                return fetch(ids, *a, **k)

            shards.fetch = counted
            plan = [(np.array([i]), i) for i in range(shards.total)]  # batches of one sample, consumed at once
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a limit of 1 byte is over at every fetch: said, not an error
                assert [i for _, i in stream.fetched_ahead(shards, iter(plan))] == list(range(shards.total))
            assert sizes[0] == 1 and sum(sizes) == shards.total, sizes
            fetches[limit] = sizes
    # windows already queued keep their size: growth shows from the fourth on
    assert 4 * stream.FETCH_WINDOW <= max(fetches[None]) <= stream.MAX_WINDOW, fetches
    assert max(fetches[1]) == stream.FETCH_WINDOW, fetches  # no room in the cache: never above the default
    assert max(fetches["bytes"]) == stream.FETCH_WINDOW, fetches  # nor over the bytes a window may hold


def test_reading_cached_samples_never_waits_behind_a_fetch_ahead(converted, tmp_path):
    """A worker fetches its next batches from a thread while it decodes this one: the decode must not wait for
    that fetch (it did: one lock was held across the download)."""
    import threading

    from fastpipe.loaders.shards import ShardSet

    faults = Faults()
    with FolderServer(converted, faults) as url:
        shards = ShardSet(load(url, cache_dir=tmp_path / "c"), "val")
        shards.fetch([0])
        faults.latency, before = 1.0, faults.requests  # from here on, every request answers after 1 s
        shards.files.counters.take()
        ahead = threading.Thread(target=shards.fetch, args=([shards.total - 1],), kwargs={"remap": False})
        ahead.start()
        while faults.requests == before:  # the fetch ahead is at the server
            time.sleep(0.01)
        image = bytes(shards.read([0]).images[0])
        answered = shards.files.counters.take()[0]  # requests completed (counted when their bytes are in)
        ahead.join()
    assert answered == 0  # sample 0 was read while the fetch ahead still waited for its answer
    assert shards.files.counters.take()[0] == 1
    assert image == ShardSet(load(converted), "val").sample(0).image


def test_a_forked_worker_leaves_the_parents_clients_alone(converted):
    """A DataLoader worker is a fork: garbage it inherits includes the parent's HTTP clients. Closing one there
    waited a second per client (fsspec's finalizer, on the parent's loop, which does not run in the child) and
    took the parent's pooled connections out of the epoll set they share, so the parent's next request on one
    hung until its timeout. The child must leave them alone: no finalizer of theirs left to run, and the
    parent's kept-alive connection still answering at once."""
    import gc
    import weakref

    from fastpipe.store.remote import Remote

    with FolderServer(converted) as url:
        gc.collect()  # the garbage of earlier tests (a Ray client's, say) is not this test's to collect in a fork
        gc.disable()  # so that the garbage below is still there at the fork
        try:
            kept = Remote(url)
            kept.cat("dataset.json")  # a pooled keep-alive connection, made before the fork
            clients = {id(kept._local[1])}
            for _ in range(3):  # clients the parent is done with, in a reference cycle: garbage at the fork
                r = Remote(url)
                r.cat("dataset.json")
                r.cycle = r
                clients.add(id(r._local[1]))
            del r

            def closers():  # these clients' finalizers (fsspec's close_session) still to run
                return [f for f in list(weakref.finalize._registry) if f.peek() and id(f.peek()[0]) in clients]

            assert len(closers()) == 4
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: what a DataLoader worker does with garbage, then exit without cleanup
                status = 1
                try:
                    gc.collect()
                    os.write(write, str(len(closers())).encode())
                    status = 0
                except BaseException as e:
                    os.write(write, f"raised {type(e).__name__}: {e}"[:2000].encode())
                finally:
                    os._exit(status)
        finally:
            gc.enable()
        os.close(write)
        if not select.select([read], [], [], 300)[0]:  # a bound, not a timing: a child stuck in a lock left by fork
            os.kill(pid, signal.SIGKILL)
        said = os.read(read, 4096)
        _, status = os.waitpid(pid, 0)
        assert said.isdigit(), f"the forked child said {said!r} and ended with wait status {status:#x}"
        left = int(said)
        kept.counters.take()
        assert kept.cat("dataset.json") == (converted / "dataset.json").read_bytes()
    assert left == 0
    assert kept.counters.take() == (1, (converted / "dataset.json").stat().st_size, 0)  # no retry, no timeout


def test_a_store_that_keeps_failing_is_named_not_waited_for(converted, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPIPE_REMOTE_ATTEMPTS", "3")
    with FolderServer(converted, Faults(error_every=1, only=".tar")) as url:
        loader = make_loader(url, split="val", num_workers=2, cache_dir=tmp_path / "c", **KW)
        t = time.perf_counter()
        with pytest.raises(Exception, match=r"val-\d+\.tar bytes \d+-\d+ still failing after 3 attempts.*503"):
            epoch(loader)
    assert time.perf_counter() - t < 30


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_replaced_in_the_store_is_named_not_read(converted, tmp_path, workers):
    """A shard overwritten after conversion (same size: the manifest's byte count still holds), read by a rank of
    four, which never has a whole shard for the sha256 check: the tar headers the index points at are not there,
    and the epoch stops naming the shard, before a label is read from the wrong bytes."""
    served = tmp_path / "set"
    shutil.copytree(converted, served)
    for tar in served.glob("train-*.tar"):
        data = tar.read_bytes()
        tar.write_bytes(b"\0" * 512 + data[:-512])  # every member one block later
    with FolderServer(served) as url:
        loader = make_loader(url, split="train", num_workers=workers, rank=0, world_size=4, cache_dir=tmp_path / "c",
                             **KW)
        with pytest.raises(DataError, match=r"train-\d+\.tar bytes \d+-\d+ are not what its index says.*replaced"):
            epoch(loader)


def test_missing_data_set_and_missing_shard_say_what(converted, tmp_path):
    with FolderServer(tmp_path) as url, pytest.raises(RemoteError, match=r"dataset.json not found"):
        make_loader(url + "/nothing", cache_dir=tmp_path / "c")
    (tmp_path / "copy").mkdir()
    for f in converted.iterdir():
        if f.is_file() and f.name != "val-000000.tar":
            (tmp_path / "copy" / f.name).write_bytes(f.read_bytes())
    with FolderServer(tmp_path / "copy") as url:
        loader = make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c", **KW)
        with pytest.raises(DataError, match=r"val-000000.tar not found"):
            epoch(loader)


@pytest.mark.parametrize(("url", "package"), [("gs://bucket/set", "gcsfs"), ("az://container/set", "adlfs")])
def test_a_missing_store_client_names_the_package(url, package, tmp_path, capsys, monkeypatch):
    from fastpipe.cli import main
    from fastpipe.errors import MissingDependency

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(MissingDependency, match=rf"needs {package}: pip install {package}"):
        make_loader(url, cache_dir=tmp_path / "c")
    assert main(["bench", url, "--cache-dir", str(tmp_path / "c")]) != 0  # the CLI: the message, no traceback
    err = capsys.readouterr().err
    assert f"pip install {package}" in err and "Traceback" not in err


def test_inspect_verify_reads_a_store_through_the_cache(converted, tmp_path, capsys):
    """`fastpipe inspect URL --verify`: every shard fetched (faults included) and every sample decoded; a shard
    altered in the store and one missing are named."""
    from fastpipe.cli import main
    from fastpipe.convert.inspect import inspect

    with FolderServer(converted, Faults(error_every=3, only=".tar")) as url:
        assert main(["inspect", url, "--verify", "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{url}: ") and "all intact" in out
    samples = sum(sp.samples for sp in load(converted).splits.values())
    assert f"verified {samples} samples" in out
    store = tmp_path / "store"
    shutil.copytree(converted, store)
    altered, missing = sorted(store.glob("train-*.tar"))[:2]
    data = bytearray(altered.read_bytes())
    data[700:900] = b"\0" * 200  # same size, other bytes
    altered.write_bytes(bytes(data))
    missing.unlink()
    with FolderServer(store) as url:
        report = inspect(url, verify=True, cache_dir=tmp_path / "c2")
    assert not report.ok
    assert any(altered.name in p and "sha256 differs" in p for p in report.problems)
    assert any(missing.name in p and "not found" in p for p in report.problems)


@pytest.mark.parametrize("kind", ["single-label", "multi-label"])
def test_inspect_repair_of_a_url_rewrites_its_indexes_in_the_store(kind, converted, tmp_path, s3_bucket):
    """A set adopted with an undecodable sample in it (its sha256 taken as it is, as `fastpipe index` does), in a
    bucket: `inspect --verify --repair URL` uploads the new index, repaired.jsonl and dataset.json, as a local
    repair writes them (multi-label: the counts are taken again from the labels, read through the node cache). A
    node cache that held part of the shard under the old index then reads the repaired set right (its presence
    bytes counted other samples: that copy starts again)."""
    from test_loaders import _corrupt_one_sample
    from test_multilabel import make_list

    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.convert.inspect import inspect
    from fastpipe.dataset.manifest import save
    from fastpipe.dataset.shardformat import read_index, sha256_file
    from fastpipe.store.remote import Remote

    endpoint, opts = s3_bucket
    opts = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": endpoint}}
    local = tmp_path / "local"
    if kind == "single-label":
        shutil.copytree(converted, local)
    else:
        (tmp_path / "src").mkdir()
        shard(ShardConfig(make_list(tmp_path / "src"), local, short_side=48, val_fraction=0.25, workers=0,
                          max_shard_size=64 * 1024))
    key = _corrupt_one_sample(local)
    m = load(local)
    bad = m.splits["train"].shards[0]
    shards = (replace(bad, sha256=sha256_file(local / bad.path)), *m.splits["train"].shards[1:])
    save(replace(m, splits={**m.splits, "train": replace(m.splits["train"], shards=shards)}))
    url = f"s3://leafs/repair/{kind}"
    Remote(url, opts).put_many([(p, p.relative_to(local).as_posix()) for p in local.rglob("*") if p.is_file()])
    node = tmp_path / "node-cache"  # this node read rank 0's half of each shard before the repair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bad sample may be in that half: skipped, with a warning
        epoch(make_loader(url, split="train", num_workers=0, rank=0, world_size=2, storage_options=opts,
                          cache_dir=node, **KW))
    report = inspect(url, verify=True, repair=True, storage_options=opts, cache_dir=tmp_path / "repairing-node")
    assert report.ok and report.repaired and f"{url}/repaired.jsonl" in "\n".join(report.lines)
    inspect(local, verify=True, repair=True)  # the same repair, locally: the reference
    store = Remote(url, opts)
    for rel in (bad.index, "repaired.jsonl", "dataset.json"):
        assert store.cat(rel) == (local / rel).read_bytes(), rel
    assert key not in [k for k, _ in read_index(local / bad.index)]
    loader = make_loader(url, split="train", num_workers=2, storage_options=opts, cache_dir=node, **KW)
    remote = epoch(loader)
    assert loader.stats.skipped == 0
    reference = epoch(make_loader(local, split="train", num_workers=0, **KW))
    assert remote[:2] == reference[:2] and torch.equal(remote[2], reference[2])


def test_credentials_never_leave_memory(converted, tmp_path, monkeypatch):
    """Neither storage_options nor the store's environment (which Remote carries to forked workers) reach a
    record: the loader's description, a repr, or any file of a training run."""
    from fastpipe.cli import main

    secret, env_secret = "SECRET-abc123", "ENV-SECRET-xyz789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_secret)
    with FolderServer(converted) as url:
        loader = make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c",
                             storage_options={"headers": {"Authorization": secret}}, **KW)
        epoch(loader)
        assert main(["train", url, "--model", "resnet18", "--epochs", "1", "--image-size", "32", "--batch-size",
                     "16", "--device", "cpu", "--workers", "0", "--out", str(tmp_path / "run"), "--cache-dir",
                     str(tmp_path / "c")]) == 0
    assert loader.manifest.files.env["AWS_SECRET_ACCESS_KEY"] == env_secret  # carried, in memory
    text = json.dumps(loader.describe(), default=str) + repr(loader.manifest) + repr(loader.manifest.files)
    assert secret not in text and env_secret not in text and url in loader.manifest.location
    written = b"".join(p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert written and env_secret.encode() not in written and secret.encode() not in written


def test_local_paths_are_unchanged(converted, tmp_path, monkeypatch):
    m = load(converted)
    assert m.files.folder == converted and m.location == str(converted)
    assert np.isclose(sum(m.mean), sum(load(str(converted)).mean))
    assert load(converted / "dataset.json").classes == m.classes
    shutil.copy(converted / "dataset.json", tmp_path / "kept-as.json")  # a manifest file by another name
    assert load(tmp_path / "kept-as.json").classes == m.classes
    monkeypatch.chdir(converted)
    assert load("").classes == m.classes and load(".").classes == m.classes


def test_a_folder_and_a_store_answer_the_same_calls(converted, tmp_path, s3_bucket, monkeypatch):
    """The location contract: the same files in a folder and in a bucket, opened by one call, read, listed, named and
    written alike; what is not there, or more than asked for, fails alike (a RemoteError saying why)."""
    from fastpipe.store.location import open_location
    from fastpipe.util import FileTooLarge

    aws_env(monkeypatch, s3_bucket[0], tmp_path)
    here, there = open_location(converted), open_location("s3://leafs/sets/v1/")
    assert (type(here).__name__, here.folder, here.cache) == ("Folder", converted, None)
    assert (isinstance(there, Remote), there.folder, there.url) == (True, None, "s3://leafs/sets/v1")
    assert here.identity == str(converted.resolve()) and there.identity == "s3://leafs/sets/v1"
    listed = here.listing()
    assert listed == there.listing() and ("dataset.json", (converted / "dataset.json").stat().st_size) in listed
    shard = next(rel for rel, _ in listed if rel.endswith(".tar"))
    for loc in (here, there):
        assert loc.relative(loc.join(shard)) == shard and loc.exists(shard) and not loc.exists("nothing.tar")
        assert loc.cat("dataset.json") == (converted / "dataset.json").read_bytes()
        assert loc.ranges([(shard, 512, 700)]) == [(converted / shard).read_bytes()[512:700]]
        assert loc.glob("*.json") == sorted(p.name for p in converted.glob("*.json"))
        with pytest.raises(RemoteError) as missing:
            loc.cat("nothing.json")
        assert isinstance(missing.value.__cause__, FileNotFoundError) and "nothing.json" in str(missing.value)
        with pytest.raises(RemoteError, match="limit"):
            loc.cat(shard, 100)
        note = tmp_path / "note.txt"
        note.write_text("kept")
        loc.put_many([(note, "notes/note.txt")])
        assert loc.cat("notes/note.txt") == b"kept"
        loc.delete("notes/note.txt")
        assert not loc.exists("notes/note.txt")
    with pytest.raises(RemoteError) as large:
        here.cat(shard, 100)
    assert isinstance(large.value.__cause__, FileTooLarge)
    with pytest.raises(ConfigError, match="inside"):
        here.join("../outside.txt")


def _upload(folder, url: str) -> None:
    from fastpipe.store.remote import Remote

    Remote(url).put_many([(p, p.relative_to(folder).as_posix()) for p in folder.rglob("*") if p.is_file()])


def test_shard_from_a_bucket_gives_the_local_bytes_and_refuses_the_same_files(tmp_path, s3_bucket, monkeypatch,
                                                                              capsys):
    """`fastpipe shard s3://.../photos OUT`: the bucket is listed (not walked), and each photo is read from the store
    by the worker that converts it. Shards, indexes, previews and rejected.jsonl are those of the same photos
    converted from a folder: hidden files ignored alike, and every rule refusing the same files (empty, not an
    image, cut short, a duplicate, too many pixels, too many bytes: that one refused from the listing, unread)."""
    from conftest import aws_env, manifest_without_source, messy_photos, tree

    from fastpipe.cli import main
    from fastpipe.convert.driver import ShardConfig, shard

    aws_env(monkeypatch, s3_bucket[0], tmp_path)
    src = tmp_path / "photos"
    limits = messy_photos(src, {"red": 10, "green": 8, "blue": 6})
    _upload(src, "s3://leafs/raw/photos")
    local = shard(ShardConfig(src, tmp_path / "local", short_side=32, val_fraction=0.25, max_shard_size=64 * 1024,
                              workers=2, **limits))
    capsys.readouterr()
    assert main(["shard", "s3://leafs/raw/photos", str(tmp_path / "remote"), "--short-side", "32", "--val-fraction",
                 "0.25", "--max-shard-size", "64KB", "--max-pixels", str(limits["max_pixels"]), "--max-file-size",
                 f"{limits['max_file_size']}B", "--workers", "2"]) == 0
    said = capsys.readouterr().out
    assert tree(tmp_path / "remote") == tree(tmp_path / "local")
    assert manifest_without_source(tmp_path / "remote" / "dataset.json") == \
        manifest_without_source(tmp_path / "local" / "dataset.json")
    assert load(tmp_path / "remote").settings["source"] == "s3://leafs/raw/photos"
    assert sorted(local.rejected.elements()) == ["duplicate", "empty", "no-class", "not-an-image", "too-large",
                                                 "too-large", "truncated"]
    assert f"rejected {sum(local.rejected.values())} (2 hidden/system files ignored)" in said


def test_keys_with_dot_segments_are_bad_names_not_hidden_files(tmp_path, s3_bucket, monkeypatch):
    """A store keeps 'photos/red/../escape.jpg' as written (no folder on disk can hold it): discovery refuses it as
    bad-name, a rejection rejected.jsonl records, not one of the hidden files it only counts."""
    from conftest import aws_env

    from fastpipe.convert.discovery import discover

    aws_env(monkeypatch, s3_bucket[0], tmp_path)
    _upload(make_folder(tmp_path / "photos", {"red": 2, "green": 2}), "s3://leafs/raw/dots")
    import s3fs

    endpoint, opts = s3_bucket
    fs = s3fs.S3FileSystem(**{**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": endpoint}},
                           skip_instance_cache=True)
    for key in ("red/../escape.jpg", "red/./here.jpg", "red/.DS_Store"):
        fs.pipe(f"leafs/raw/dots/{key}", b"\xff\xd8 not read")
    source = discover("s3://leafs/raw/dots")
    assert sorted((r.path, r.reason) for r in source.rejections) == [("red/../escape.jpg", "bad-name"),
                                                                      ("red/./here.jpg", "bad-name")]
    assert source.ignored == 1 and len(source.items) == 4


def test_a_list_in_a_bucket_takes_paths_and_urls_inside_its_folder_only(tmp_path, s3_bucket, monkeypatch):
    """A CSV in a bucket: rows relative to its folder or URLs inside it give the shards of the same list on disk; a
    row leaving the folder (another prefix, '..', a URL with keys in it) is refused as outside-root, its keys not
    written; a row naming an object that is not there is refused as missing, when it is read."""
    from conftest import aws_env, tree

    from fastpipe.convert.driver import ShardConfig, shard

    aws_env(monkeypatch, s3_bucket[0], tmp_path)
    src = make_folder(tmp_path / "photos", {"red": 6, "green": 5})
    rows = [f"{p.relative_to(src).as_posix()},{p.parent.name}" for p in sorted(src.rglob("*.jpg"))]
    hostile = ["../secret.jpg,red", "red/missing.jpg,red"]
    (src / "photos.csv").write_text("\n".join(rows + hostile) + "\n")
    folder = "s3://leafs/raw/listed"
    as_urls = [f"{folder}/{r}" if r.startswith("red/") else r for r in rows]
    keys = ["s3://leafs/raw/other/x.jpg,red", f"s3://AKIDSECRET:abc@{folder[5:]}/red/img_000.jpg,red"]
    _upload(src, folder)
    Remote(folder).put_many([(_text(tmp_path / "l.csv", as_urls + hostile + keys), "photos.csv")])
    kw = dict(short_side=32, val_fraction=0.25, max_shard_size=64 * 1024, workers=1)
    shard(ShardConfig(src / "photos.csv", tmp_path / "local", **kw))
    shard(ShardConfig(f"{folder}/photos.csv", tmp_path / "remote", **kw))
    skip = ("dataset.json", "rejected.jsonl")
    assert tree(tmp_path / "remote", skip) == tree(tmp_path / "local", skip)
    rejected = {r["path"]: r["reason"] for r in map(json.loads, (tmp_path / "remote" / "rejected.jsonl").open())}
    assert rejected == {"../secret.jpg": "outside-root", "red/missing.jpg": "missing",
                        "s3://leafs/raw/other/x.jpg": "outside-root",
                        f"s3://***@{folder[5:]}/red/img_000.jpg": "outside-root"}
    assert b"AKIDSECRET" not in (tmp_path / "remote" / "rejected.jsonl").read_bytes()


def test_an_http_src_is_a_list_not_a_folder(tmp_path):
    """An http(s) server cannot be listed: a folder URL says so and what to give instead; a list there converts as
    the same list on disk, each photo fetched by its URL."""
    from conftest import tree

    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.errors import ConfigError

    src = make_folder(tmp_path / "photos", {"red": 5, "green": 4})
    rows = [f"{p.relative_to(src).as_posix()},{p.parent.name}" for p in sorted(src.rglob("*.jpg"))]
    (src / "photos.csv").write_text("\n".join(rows) + "\n")
    kw = dict(short_side=32, val_fraction=0.25, workers=1)
    shard(ShardConfig(src / "photos.csv", tmp_path / "local", **kw))
    with FolderServer(src) as url:
        shard(ShardConfig(f"{url}/photos.csv", tmp_path / "remote", **kw))
        with pytest.raises(ConfigError, match=r"cannot be listed.*give a list instead"):
            shard(ShardConfig(url, tmp_path / "folder", **kw))
    assert tree(tmp_path / "remote") == tree(tmp_path / "local")


def _text(path, rows: list[str]):
    path.write_text("\n".join(rows) + "\n")
    return path


def test_shard_into_s3_gives_the_local_bytes_and_leaves_only_the_cache(folder, tmp_path, s3_bucket, monkeypatch):
    """`fastpipe shard SRC s3://...` with the endpoint and keys from the standard AWS environment."""
    from fastpipe.cli import main
    from fastpipe.convert.driver import ShardConfig, shard

    endpoint, _ = s3_bucket
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "FASTPIPE_CACHE": str(tmp_path / "cache" / "shards")}.items():
        monkeypatch.setenv(k, v)
    settings = dict(short_side=48, val_fraction=0.25, max_shard_size=64 * 1024, workers=1)
    shard(ShardConfig(folder, tmp_path / "local", **settings))
    assert main(["shard", str(folder), "s3://leafs/written/v1", "--short-side", "48", "--val-fraction", "0.25",
                 "--max-shard-size", "64KB", "--workers", "1"]) == 0
    from fastpipe.store.remote import Remote

    remote = Remote("s3://leafs/written/v1")
    local = sorted(p.relative_to(tmp_path / "local").as_posix() for p in (tmp_path / "local").rglob("*")
                   if p.is_file() and not p.name.startswith("."))
    assert [remote.cat(rel) for rel in local] == [(tmp_path / "local" / rel).read_bytes() for rel in local]
    assert not (tmp_path / "cache" / "staging").exists() or not any((tmp_path / "cache" / "staging").iterdir())
    keys, labels, _ = epoch(make_loader("s3://leafs/written/v1", split="val", num_workers=0, **KW))
    assert (keys, labels) == epoch(make_loader(tmp_path / "local", split="val", num_workers=0, **KW))[:2]


@pytest.mark.parametrize("problem", ["no bucket", "no credentials"])
def test_shard_into_a_store_it_cannot_write_fails_before_converting(folder, tmp_path, s3_bucket, monkeypatch,
                                                                     capsys, problem):
    """A bucket that does not exist converted everything, then failed on an upload and left a staging folder;
    missing credentials were retried 6 times. Both are said at once, before a photo is converted."""
    from fastpipe.cli import main

    endpoint, _ = s3_bucket
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "FASTPIPE_CACHE": str(tmp_path / "c"),
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "AWS_CONFIG_FILE": str(tmp_path / "none")}
    if problem == "no bucket":
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    else:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = "no-such-bucket" if problem == "no bucket" else "leafs"
    assert main(["shard", str(folder), f"s3://{bucket}/v1", "--short-side", "48", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write to s3://{bucket}/v1 (nothing was converted yet)" in err, err
    assert ("access refused" in err and "after" not in err) if problem == "no credentials" else "not found" in err
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.tar*"))


def test_an_interrupted_upload_resumes_with_the_same_bytes(folder, tmp_path, s3_bucket, monkeypatch, capsys):
    """The store fails while `shard SRC s3://...` uploads: the run says so and keeps its staging folder, the
    bucket has no dataset.json (no reader sees a partial set), and the same command run again finishes it."""
    from fastpipe.cli import main
    from fastpipe.store.remote import Remote

    endpoint, _ = s3_bucket
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "FASTPIPE_CACHE": str(tmp_path / "cache" / "shards"), "FASTPIPE_REMOTE_ATTEMPTS": "2"}.items():
        monkeypatch.setenv(k, v)
    args = ["shard", str(folder), "s3://leafs/resumed/v1", "--short-side", "48", "--val-fraction", "0.25",
            "--max-shard-size", "64KB", "--workers", "1"]
    with FolderServer(None, Faults(error_every=1, only=".idx"), proxy_to=endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy)
        assert main(args) != 0
    assert "still failing after 2 attempts" in capsys.readouterr().err
    staging = tmp_path / "cache" / "staging"
    assert any(staging.iterdir())
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(RemoteError, match=r"dataset\.json not found"):
        Remote("s3://leafs/resumed/v1").cat("dataset.json")
    assert main(args) == 0
    assert not any(staging.iterdir())
    assert main([*args[:2], "s3://leafs/written/v2", *args[3:]]) == 0  # a fresh run, for comparison
    fresh, resumed = Remote("s3://leafs/written/v2"), Remote("s3://leafs/resumed/v1")
    names = ["dataset.json"] + [s.path for split in ("train", "val") for s in load(fresh.url).split(split).shards]
    assert [resumed.cat(n) for n in names] == [fresh.cat(n) for n in names]


def test_a_conversion_whose_machine_is_lost_resumes_on_another(tmp_path, s3_bucket, monkeypatch, capsys):
    """`shard SRC s3://...` is killed mid-way and its machine's disk is gone (its staging folder deleted). The
    same command on another machine (another cache folder, the photos copied to another path) resumes from the
    journal the first mirrored into the bucket: it converts fewer than all the photos, does not upload again the
    shards it downloaded (but does one it found damaged there and converted again), gives the bytes of an
    uninterrupted run, and removes the journal from the bucket."""
    from conftest import make_folder

    from fastpipe.cli import main
    from fastpipe.convert.journal import journal_shards
    from fastpipe.store.remote import Remote

    endpoint, _ = s3_bucket
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FASTPIPE_MIRROR_SECONDS": "0.1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    src = make_folder(tmp_path / "src", {"red": 50, "green": 50, "blue": 50}, size=(800, 600))
    # without near-copy fingerprints the photos are converted while the shards are written, not while hashing: the
    # shards then come one by one, and the journal mirrored meanwhile shows them
    args = ["--short-side", "96", "--max-shard-size", "64KB", "--workers", "1", "--near-duplicates", "off"]
    url = "s3://leafs/lost/v1"
    first = tmp_path / "machine-a" / "shards"
    # The machine is lost before its dataset.json lands, whatever the speed of this machine: that upload never ends
    # (a proxy holds it), and the kill waits for the event it needs, two shards mirrored into the bucket.
    held = Faults(stall_every=1, stall=600, only="PUT /leafs/lost/v1/dataset.json")  # its upload, not a look
    with FolderServer(None, held, proxy_to=endpoint) as proxy:
        proc = subprocess.Popen([sys.executable, "-m", "fastpipe", "shard", str(src), url, *args],
                                env={**os.environ, "FASTPIPE_CACHE": str(first), "AWS_ENDPOINT_URL": proxy},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        remote, deadline, mirrored = Remote(url), time.time() + 600, []
        while len(mirrored) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
            if remote.exists(".fastpipe-progress.jsonl"):
                mirrored = journal_shards(remote.cat(".fastpipe-progress.jsonl").decode())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(mirrored) >= 2 and not remote.exists("dataset.json"), "nothing mirrored"

    shutil.rmtree(tmp_path / "machine-a")  # the lost machine's disk
    damaged = tmp_path / "damaged.tar"  # the last mirrored shard, damaged in the store: converted again, uploaded
    data = bytearray(remote.cat(mirrored[-1]["path"]))
    data[600:700] = bytes(100)  # inside the first image (a tar ends in zeros: the last bytes would not do)
    damaged.write_bytes(bytes(data))
    remote.put_many([(damaged, mirrored[-1]["path"])])
    monkeypatch.setenv("FASTPIPE_CACHE", str(tmp_path / "machine-b" / "shards"))
    src = shutil.copytree(src, tmp_path / "machine-b" / "photos")  # mounted elsewhere there
    uploads = Faults(only=f"PUT /leafs/lost/v1/{mirrored[0]['path']}")  # counts them, injects nothing
    with FolderServer(None, uploads, proxy_to=endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy)
        assert main(["shard", str(src), url, *args]) == 0
    assert uploads.requests and uploads.count == 0  # a restored shard is not uploaded again
    out = capsys.readouterr().out
    restored = re.search(r"resumed from the journal in the store \((\d+) shards already converted\)", out)
    assert restored and int(restored.group(1)) >= len(mirrored), out
    converted = re.search(r"(\d+) images processed", out)  # the restored shards' images are not converted again
    assert converted and 0 < int(converted.group(1)) < 150, out
    from fastpipe.convert.driver import ShardConfig, shard

    shard(ShardConfig(src, tmp_path / "clean", short_side=96, max_shard_size=64 * 1024, workers=1,
                      near_duplicates="off"))
    clean = tmp_path / "clean"
    names = ["dataset.json"] + [p.name for p in sorted(clean.glob("*.tar")) + sorted(clean.glob("*.idx"))]
    assert [remote.cat(n) for n in names] == [(clean / n).read_bytes() for n in names]
    assert not remote.exists(".fastpipe-progress.jsonl")


def test_parts_into_a_bucket_then_merge_there(folder, tmp_path, s3_bucket, monkeypatch, capsys):
    """A cluster conversion into one bucket prefix: `shard SRC s3://... --parts 2 --part i` per machine, then
    `fastpipe merge s3://...`. Merging before every part is done names the missing one; the merged set reads back
    exactly as the same parts merged in a local folder, with a preview per class; nothing stays on local disk but
    the cache."""
    from fastpipe.cli import main
    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.convert.merge import merge_parts
    from fastpipe.store.remote import Remote

    endpoint, _ = s3_bucket
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "FASTPIPE_CACHE": str(tmp_path / "cache" / "shards")}.items():
        monkeypatch.setenv(k, v)
    url, settings = "s3://leafs/cluster/v1", dict(short_side=48, val_fraction=0.25, max_shard_size=64 * 1024)
    args = ["--short-side", "48", "--val-fraction", "0.25", "--max-shard-size", "64KB", "--workers", "1"]
    for i in range(2):
        shard(ShardConfig(folder, tmp_path / "local", parts=2, part=i, workers=1, **settings))
    merge_parts(tmp_path / "local")
    assert main(["shard", str(folder), url, "--parts", "2", "--part", "1", *args]) == 0
    assert f"fastpipe merge {url}" in capsys.readouterr().out
    assert main(["merge", url]) == 2
    assert "parts [0] of 2 are missing" in capsys.readouterr().err
    assert main(["shard", str(folder), url, "--parts", "2", "--part", "0", *args]) == 0
    assert main(["merge", url]) == 0
    remote, local = Remote(url), load(tmp_path / "local")
    merged = load(url)
    assert merged.splits == local.splits and merged.mean == pytest.approx(local.mean)
    assert sorted(merged.outputs["previews"]) == sorted(local.classes)
    assert all(remote.cat(f)[:2] == b"\xff\xd8" for f in merged.outputs["previews"].values())  # JPEGs
    assert remote.cat("rejected.jsonl") == (tmp_path / "local" / "rejected.jsonl").read_bytes()
    for name in ("_info.json", "wids-train.json", "wids-val.json"):  # other readers' files, written by the merge
        assert remote.cat(name) == (tmp_path / "local" / name).read_bytes()
    for split in ("train", "val"):
        keys, labels, _ = epoch(make_loader(url, split=split, num_workers=0, **KW))
        assert (keys, labels) == epoch(make_loader(tmp_path / "local", split=split, num_workers=0, **KW))[:2]
    staging = tmp_path / "cache" / "staging"
    assert not staging.exists() or not any(staging.iterdir())


def test_index_adopts_foreign_shards_in_a_bucket(tmp_path, s3_bucket, monkeypatch, capsys):
    """`fastpipe index s3://.../a.tar ... --val ...`: shards another tool wrote into a bucket get their .idx files
    and dataset.json beside them (the tars untouched, nothing left on local disk but the cache), and read back
    exactly as the same shards indexed locally; indexing again needs --overwrite."""
    from conftest import webdataset_shards

    from fastpipe.cli import main
    from fastpipe.convert.foreign import IndexConfig, index_shards
    from fastpipe.store.remote import Remote

    endpoint, _ = s3_bucket
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "FASTPIPE_CACHE": str(tmp_path / "cache" / "shards")}.items():
        monkeypatch.setenv(k, v)
    local = tmp_path / "local"
    tars = webdataset_shards(local, count=15, per_shard=6)
    bucket = Remote("s3://leafs/foreign")
    bucket.put_many([(t, t.name) for t in tars])
    (tmp_path / "theirs.json").write_text('{"splits": {}}')  # timm's info of the tool that wrote the shards
    bucket.put_many([(tmp_path / "theirs.json", "_info.json")])
    urls = [f"s3://leafs/foreign/{t.name}" for t in tars]
    assert main(["index", *urls[:2], "--val", urls[2]]) == 0
    assert "-> s3://leafs/foreign/dataset.json" in capsys.readouterr().out
    index_shards(IndexConfig(tars[:2], val=tars[2:]))  # the same shards, indexed on the local disk
    for t in tars:
        assert bucket.cat(t.name) == t.read_bytes()  # the shards are not rewritten
        assert bucket.cat(t.with_suffix(".idx").name) == t.with_suffix(".idx").read_bytes()
    assert bucket.cat("_info.json") == b'{"splits": {}}'  # the user's, kept; the wids descriptors are fastpipe's
    assert [bucket.cat(n) for n in ("wids-train.json", "wids-val.json")] == [
        (local / n).read_bytes() for n in ("wids-train.json", "wids-val.json")]
    assert not any((tmp_path / "cache" / "staging").iterdir())
    for split in ("train", "val"):
        remote = epoch(make_loader("s3://leafs/foreign", split=split, num_workers=0, **KW))
        assert remote[:2] == epoch(make_loader(local, split=split, num_workers=0, **KW))[:2]
    assert main(["index", *urls[:2], "--val", urls[2]]) == 2
    assert "add --overwrite" in capsys.readouterr().err
    assert main(["index", urls[0], "s3://leafs/elsewhere/part-000.tar"]) == 2
    assert "all in one folder" in capsys.readouterr().err
    bucket.delete(tars[0].with_suffix(".idx").name)  # a lost index: rebuilt in place, nothing else written
    assert main(["index", "--idx-only", urls[0]]) == 0
    assert bucket.cat(tars[0].with_suffix(".idx").name) == tars[0].with_suffix(".idx").read_bytes()
    assert main(["index", "--idx-only", urls[0], str(tars[1])]) == 2
    assert "not both in one command" in capsys.readouterr().err
    assert main(["inspect", "s3://leafs/foreign"]) == 0  # an adopted set has no rejected.jsonl: not an error
    assert "s3://leafs/foreign: 3 classes" in capsys.readouterr().out


def test_train_and_bench_take_a_url(converted, tmp_path):
    from fastpipe.cli import main

    with FolderServer(converted) as url:
        assert main(["train", url, "--model", "resnet18", "--epochs", "1", "--image-size", "32", "--batch-size", "16",
                     "--device", "cpu", "--workers", "0", "--out", str(tmp_path / "run"), "--cache-dir",
                     str(tmp_path / "c"), "--cache-limit", "1GB"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["root"] == url and config["train"]["cache_limit"] == "1GB"


def test_doctor_reports_protocols_and_the_endpoint(s3_bucket, monkeypatch, capsys):
    from fastpipe.doctor import run_doctor

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket[0])
    run_doctor()
    out = capsys.readouterr().out
    assert "reads s3://" in out and "http://" in out and f"{s3_bucket[0]} answers" in out
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    run_doctor()
    assert "does not answer" in capsys.readouterr().out


def test_foreign_shards_in_a_bucket_are_indexed_where_they_are_into_a_local_folder(tmp_path, s3_bucket, monkeypatch):
    """`index s3://.../*.tar --out FOLDER`: a store that lists no sha256 has each shard streamed once through it
    (said in dataset.json); the manifest in FOLDER reads the shards from the bucket as the same shards indexed here."""
    from conftest import aws_env, webdataset_shards

    from fastpipe.cli import main
    from fastpipe.store.remote import Remote

    aws_env(monkeypatch, s3_bucket[0], tmp_path)
    tars = webdataset_shards(tmp_path / "local", count=15, per_shard=6)
    Remote("s3://leafs/theirs").put_many([(t, t.name) for t in tars])
    urls = [f"s3://leafs/theirs/{t.name}" for t in tars]
    assert main(["index", *urls[:2], "--val", urls[2], "--out", str(tmp_path / "idx")]) == 0
    assert main(["index", *map(str, tars[:2]), "--val", str(tars[2])]) == 0
    m = load(tmp_path / "idx")
    assert m.settings["shards_at"] == "s3://leafs/theirs" and m.settings["sha256_from"] == "each shard read once"
    assert [s.sha256 for s in m.splits["train"].shards] == [s.sha256 for s in load(tmp_path / "local").splits[
        "train"].shards]
    for split in ("train", "val"):
        assert epoch(make_loader(tmp_path / "idx", split=split, num_workers=0, **KW))[:2] == \
            epoch(make_loader(tmp_path / "local", split=split, num_workers=0, **KW))[:2]


def test_a_manifest_in_a_store_sends_our_options_only_to_shards_in_its_own_bucket(tmp_path, s3_bucket, monkeypatch):
    """A dataset.json read from a store names where its shards are (settings.shards_at): storage_options (keys,
    headers) go with those requests only within the manifest's own scheme and bucket."""
    import json

    from conftest import aws_env, webdataset_shards

    from fastpipe.cli import main
    from fastpipe.store.remote import Remote

    aws_env(monkeypatch, s3_bucket[0], tmp_path)
    tars = webdataset_shards(tmp_path / "local", count=6, per_shard=6)
    Remote("s3://leafs/theirs").put_many([(t, t.name) for t in tars])
    assert main(["index", f"s3://leafs/theirs/{tars[0].name}", "--out", "s3://leafs/ours"]) == 0
    opts = {"client_kwargs": {"region_name": "us-east-1"}}
    assert load("s3://leafs/ours", storage_options=opts).files.shards.options == opts
    d = json.loads(Remote("s3://leafs/ours").cat("dataset.json"))
    d["settings"]["shards_at"] = "s3://elsewhere/theirs"
    (tmp_path / "dataset.json").write_text(json.dumps(d))
    Remote("s3://leafs/ours").put_many([(tmp_path / "dataset.json", "dataset.json")])
    assert load("s3://leafs/ours", storage_options=opts).files.shards.options == {}
    for elsewhere in ("file:///etc", "http://169.254.169.254/latest"):  # this machine's files, another host
        d["settings"]["shards_at"] = elsewhere
        (tmp_path / "dataset.json").write_text(json.dumps(d))
        Remote("s3://leafs/ours").put_many([(tmp_path / "dataset.json", "dataset.json")])
        with pytest.raises(DataError, match="not in the same kind of store"):
            load("s3://leafs/ours")

"""`fastpipe shard SRC s3://bucket/prefix`: a conversion written into object storage; and `fastpipe index` of
shards already in a store (their indexes and manifest written beside them).

The conversion runs into a staging folder on this node (beside the shard cache), exactly as a local one (resumable,
byte-deterministic), and is then uploaded: every shard, index, preview and rejection record first, several at a
time, and `dataset.json` last, so a reader never finds a manifest whose shards are not all there. Each object is
one PUT, complete or absent. The staging folder is deleted once the upload is complete; an interrupted run keeps
it, and running the same command again resumes there and uploads again (the same bytes).

A cluster conversion (`--parts N --part i` into one URL) uploads each part's shards, indexes, rejections and
part manifest (last); `fastpipe merge URL` then downloads only the part manifests and rejection records, fetches
the few images its previews show (each part's manifest holds a uniform sample of each class: previews.candidates),
and uploads rejected.jsonl, the previews and dataset.json (last). No shard is read whole.

While it converts, a thread copies each finished shard, then the journal that lists it, into the store
(`_Mirror`): a machine lost mid-conversion is resumed by any other running the same command, which downloads the
journal and the shards it lists (each checked against its sha256) and goes on from there, with the same bytes.
The store's copy of the journal is deleted once dataset.json is uploaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from fastpipe.cache import default_cache_dir
from fastpipe.cachefiles import private_folder
from fastpipe.convert import readers
from fastpipe.convert.journal import journal_name, journal_shards
from fastpipe.errors import ConfigError
from fastpipe.manifest import MANIFEST_NAME, load
from fastpipe.storage import Remote, is_url
from fastpipe.util import Ticker


def staging_folder(url: str) -> Path:
    """Where a conversion into a store is written first: below a folder private to this user (the converter writes
    and later uploads what is there)."""
    return private_folder(default_cache_dir().parent / "staging") / hashlib.sha256(url.encode()).hexdigest()[:16]


def shard_to_url(cfg, shard, storage_options: dict | None = None):
    """Convert into the staging folder with `shard` (resuming from the store's journal when this node has none),
    mirroring progress into the store; upload the rest, dataset.json last; delete the staging folder."""
    url = str(cfg.out).rstrip("/")
    remote = Remote(url, storage_options)
    remote.check_writable()  # before converting: a missing bucket or credentials are said now, not after the work
    staging = staging_folder(url + cfg.suffix)  # the parts of a cluster job may share a node
    name = journal_name(cfg.suffix)
    restored = _restore(staging, remote, name)
    with _Mirror(staging, remote, name, restored) as mirror:
        summary = shard(replace(cfg, out=staging))
    upload(staging, remote, skip=mirror.in_store())
    remote.delete(name)
    shutil.rmtree(staging)
    summary.out = url
    summary.notes.append(f"uploaded to {url} (dataset{cfg.suffix}.json last); staging folder {staging} removed")
    if restored:
        summary.notes.insert(0, f"resumed from the journal in the store ({len(restored) // 2} shards already "
                                f"converted)")
    return summary


MIRROR_SECONDS = float(os.environ.get("FASTPIPE_MIRROR_SECONDS", 2))


class _Mirror(Ticker):
    """Every MIRROR_SECONDS while a conversion runs: the shards (.tar, .idx) its journal lists that the store
    lacks, then the journal as read, so the store's journal never lists a shard the store lacks. A failing store
    does not stop the conversion: the final upload (which skips what the store has) retries and reports."""

    def __init__(self, staging: Path, remote: Remote, name: str, in_store: dict[str, tuple]):
        super().__init__(MIRROR_SECONDS, self._quietly, "fastpipe-mirror")
        self.staging, self.remote, self.name = staging, remote, name
        # each file the store has as it is here, with its stamp: the restored ones to begin with, so that a
        # conversion resumed on another machine does not upload again every shard it downloaded
        self.sent: dict[str, tuple | None] = dict(in_store)

    def in_store(self) -> set[str]:
        """The files the store has as they are here (one the driver rewrote since, it does not)."""
        return {n for n, stamp in self.sent.items() if stamp == _stamp(self.staging / n)}

    def _quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.sync()

    def sync(self) -> None:
        try:
            text = (self.staging / self.name).read_text()
        except OSError:
            return  # not started, or finished (the journal is removed once dataset.json is written)
        stamps = {n: _stamp(self.staging / n) for sh in journal_shards(text) for n in (sh["path"], sh["index"])}
        todo = {n: stamp for n, stamp in stamps.items() if self.sent.get(n) != stamp}
        self.remote.put_many([(self.staging / n, n) for n in todo])
        self.sent.update(todo)
        copy = self.staging / f"{self.name}.mirror"
        copy.write_text(text)
        self.remote.put_many([(copy, self.name)])


def _restore(staging: Path, remote: Remote, name: str) -> dict[str, tuple | None]:
    """A journal in the store and none here: download it and the shards it lists; the driver checks each shard
    (sha256) as it resumes. Returns each file restored (.tar, .idx) with its stamp."""
    if (staging / name).exists() or not remote.exists(name):
        return {}
    staging.mkdir(parents=True, exist_ok=True)
    text = remote.cat(name).decode()
    names = [n for sh in journal_shards(text) for n in (sh["path"], sh["index"])]
    remote.get_many([(n, staging / n) for n in names])
    (staging / name).write_text(text)  # last: a restore cut short leaves no journal, so it is done again
    return {n: _stamp(staging / n) for n in names}


def _stamp(path: Path) -> tuple | None:
    """What tells a file from a rewrite of it (a resumed conversion replaces a bad shard by a new file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def merge_to_url(url: str, storage_options: dict | None = None):
    """`fastpipe merge URL`: the parts of a cluster conversion in a store, merged (see the module's note)."""
    from fastpipe.convert.merge import merge_in

    url = url.rstrip("/")
    remote = Remote(url, storage_options)
    records = remote.glob("dataset.part-*-of-*.json") + remote.glob("rejected.part-*-of-*.jsonl")
    staging = staging_folder(url + "#merge")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    def read(locations):
        return remote.ranges([(rel, off, off + size) for rel, (off, size) in locations])

    try:  # nothing to resume: a failed merge is run again from the store
        remote.get_many([(n, staging / n) for n in records])
        merge_in(staging, read, where=url)
        upload(staging, remote, skip=set(records))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return load(url, storage_options)


def index_to_url(cfg, index_shards, storage_options: dict | None = None):
    """`fastpipe index URL/a.tar URL/b.tar ...`: foreign shards already in a store. Each is downloaded once into a
    staging folder (a tar is read whole to index it), indexed there, and the `.idx` files, previews and
    dataset.json (last) are uploaded beside the shards, which are not rewritten."""
    urls = [str(u).rstrip("/") for u in [*cfg.train, *cfg.val]]
    prefix = urls[0].rsplit("/", 1)[0]
    if any(u.rsplit("/", 1)[0] != prefix for u in urls) or not all(is_url(u) for u in urls):
        raise ConfigError(f"shards in a store are indexed together when they are all in one folder (prefix), "
                          f"where dataset.json will go: {', '.join(urls[:3])}...")
    if cfg.out or cfg.idx_only:
        raise ConfigError("--out and --idx-only take local shards: shards in a store get their dataset.json and "
                          ".idx files beside them")
    remote = Remote(prefix, storage_options)
    if remote.exists(MANIFEST_NAME) and not cfg.overwrite:
        raise ConfigError(f"{prefix}/{MANIFEST_NAME} already describes a data set; `fastpipe index` would replace "
                          f"it: add --overwrite")
    staging = staging_folder(prefix + "#index")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    names = [u.rsplit("/", 1)[1] for u in urls]
    theirs = _users_reader_files(remote)
    remote.get_many([(n, staging / n) for n in names + theirs])  # theirs: kept by index_shards, as in a folder
    local = replace(cfg, train=[staging / n for n in names[: len(cfg.train)]],
                    val=[staging / n for n in names[len(cfg.train):]])
    index_shards(local)
    upload(staging, remote, skip=set(names + theirs))
    shutil.rmtree(staging)
    return load(prefix, storage_options)  # the manifest as the store now has it


def _users_reader_files(remote: Remote) -> list[str]:
    """Reader files (convert/readers.py) in the store that no dataset.json of ours there lists: the user's."""
    ours = []
    if remote.exists(MANIFEST_NAME):
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            ours = list(json.loads(remote.cat(MANIFEST_NAME)).get("outputs", {}).get("readers", []))
    return [n for n in readers.names(("train", "val")) if n not in ours and remote.exists(n)]


def index_only_urls(urls: list[str], storage_options: dict | None = None) -> int:
    """`fastpipe index --idx-only URL/a.tar ...`: each shard downloaded once into a staging folder, indexed, and
    its .idx uploaded beside it (nothing else is written). Returns the samples indexed."""
    from fastpipe.convert.foreign import index_only
    from fastpipe.shardformat import index_path_for

    staging = staging_folder("#idx-only " + " ".join(urls))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    total = 0
    try:
        for url in urls:
            prefix, name = url.rstrip("/").rsplit("/", 1)
            remote = Remote(prefix, storage_options)
            remote.get_many([(name, staging / name)])
            total += index_only([staging / name])
            idx = index_path_for(staging / name)
            remote.put_many([(idx, idx.name)])
            (staging / name).unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return total


def upload(folder: Path, remote: Remote, skip: set[str] = frozenset()) -> None:
    """Every file fastpipe wrote in `folder` (not its lock or journal, nor those in `skip`), the manifest
    (dataset.json, or a part's dataset.part-*.json) last."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder).as_posix() not in skip
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    last = [p for p in files if p.parent == folder and p.name.startswith("dataset") and p.suffix == ".json"]
    remote.put_many([(p, p.relative_to(folder).as_posix()) for p in files if p not in last])
    remote.put_many([(p, p.name) for p in last])


__all__ = ["index_only_urls", "index_to_url", "merge_to_url", "shard_to_url", "staging_folder", "upload"]

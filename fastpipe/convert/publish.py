"""Writing into object storage: `fastpipe shard SRC s3://bucket/prefix`, and the staging folder and upload that
`merge` and `index` of a store use too (merge.py and foreign.py call this module; it calls neither).

The conversion runs into a staging folder on this node (beside the shard cache), exactly as a local one (resumable,
byte-deterministic), and is then uploaded: every shard, index, preview and rejection record first, several at a
time, and `dataset.json` last, so a reader never finds a manifest whose shards are not all there. Each object is
one PUT, complete or absent. The staging folder is deleted once the upload is complete; an interrupted run keeps
it, and running the same command again resumes there and uploads again (the same bytes).

While it converts, a thread copies each finished shard, then the journal that lists it, into the store
(`_Mirror`): a machine lost mid-conversion is resumed by any other running the same command, which downloads the
journal and the shards it lists (each checked against its sha256) and goes on from there, with the same bytes.
The store's copy of the journal is deleted once dataset.json is uploaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

from fastpipe.convert import outputs
from fastpipe.convert.datacard import CARD_MARK, card
from fastpipe.convert.journal import journal_name, journal_shards
from fastpipe.errors import ConfigError
from fastpipe.store import hub
from fastpipe.store.cache import default_cache_dir
from fastpipe.store.cachefiles import private_folder
from fastpipe.store.remote import Remote
from fastpipe.util import Ticker, parse_json


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
    hub = remote.protocol == "hf"  # one commit at the end: no journal mirrored shard by shard into the history
    restored = {} if hub else _restore(staging, remote, name)
    before = _published(staging, remote, f"dataset{cfg.suffix}.json", name)
    with contextlib.nullcontext(None) if hub else _Mirror(staging, remote, name, restored) as mirror:
        try:
            summary = shard(replace(cfg, out=staging))
        except ConfigError as e:  # the store's conversion is another one: said of the URL, not the staging folder
            if before is not None:  # the staging folder held only the store's manifest: not a conversion to resume
                shutil.rmtree(staging, ignore_errors=True)
            raise type(e)(str(e).replace(str(staging), url)) from None
    stale = _stale(before, staging / f"dataset{cfg.suffix}.json")
    upload(staging, remote, skip=mirror.in_store() if mirror else set(), remove=stale)
    if not hub:
        remote.delete(name)
    shutil.rmtree(staging)
    summary.out = url
    summary.notes.append(f"uploaded to {url} " + ("in one commit" if hub else f"(dataset{cfg.suffix}.json last)")
                         + f"; staging folder {staging} removed")
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
        self.staging, self.store, self.name = staging, remote, name
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
        self.store.put_many([(self.staging / n, n) for n in todo])
        self.sent.update(todo)
        copy = self.staging / f"{self.name}.mirror"
        copy.write_text(text)
        self.store.put_many([(copy, self.name)])


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


def _published(staging: Path, remote: Remote, manifest: str, journal: str):
    """The conversion the store holds (its manifest, checked), copied into a fresh staging folder, where the
    driver meets it as it meets a local OUT's: the same conversion is up to date, another one needs --overwrite.
    None where the store holds none, or this node is resuming its own."""
    if (staging / manifest).exists() or (staging / journal).exists() or not remote.exists(manifest):
        return None
    staging.mkdir(parents=True, exist_ok=True)
    (staging / manifest).write_bytes(remote.cat(manifest))
    return outputs.read_manifest(staging / manifest)[0]


def _stale(before, manifest: Path) -> set[str]:
    """Files of the store's former conversion that the new one does not have (its shards were cut otherwise):
    removed with the upload, so that no reader (the Hub's viewer, a train-*.tar pattern) meets them."""
    after = outputs.read_manifest(manifest)[0] if before is not None else None
    if after is None:
        return set()
    names = {p.relative_to(before.root).as_posix() for p in outputs.manifest_files(before)}
    return names - {p.relative_to(after.root).as_posix() for p in outputs.manifest_files(after)}


def upload(folder: Path, remote: Remote, skip: set[str] = frozenset(), remove: set[str] = frozenset()) -> None:
    """Every file fastpipe wrote in `folder` (not its lock or journal, nor those in `skip`), the manifest
    (dataset.json, or a part's dataset.part-*.json) last; then the store's files in `remove` are deleted."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder).as_posix() not in skip
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    if remote.protocol == "hf":
        return _commit(folder, remote, files, remove)
    last = [p for p in files if p.parent == folder and p.name.startswith("dataset") and p.suffix == ".json"]
    remote.put_many([(p, p.relative_to(folder).as_posix()) for p in files if p not in last])
    remote.put_many([(p, p.name) for p in last])
    for rel in sorted(remove):
        remote.delete(rel)


def _commit(folder: Path, remote: Remote, files: list[Path], remove: set[str]) -> None:
    """A Hub repository gets the files in one commit (the files in `remove` deleted in it), and a data card
    (datacard.py says where) where it has no README.md, or has the one fastpipe wrote."""
    rels = [(p, p.relative_to(folder).as_posix()) for p in files]
    manifest = folder / "dataset.json"
    text = card(parse_json(manifest.read_bytes()), remote.url) if manifest.is_file() else None
    if text and (not remote.exists("README.md") or CARD_MARK in remote.cat("README.md").decode("utf-8", "replace")):
        card_file = folder / ".fastpipe-card.md"
        card_file.write_text(text)
        rels.append((card_file, "README.md"))
    what = "a converted data set" if manifest.is_file() else "a part of a converted data set"
    hub.commit(remote.url, rels, f"fastpipe: {what} ({len(files)} files)", remote.options, remote._retry, folder,
               remove=sorted(remove))


__all__ = ["shard_to_url", "staging_folder", "upload"]

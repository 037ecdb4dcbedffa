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

Left out, deliberately: the journal is kept on this node, not in the bucket (a lost machine restarts the
conversion, with the same result).
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

from fastpipe.cache import default_cache_dir
from fastpipe.errors import ConfigError
from fastpipe.manifest import MANIFEST_NAME, load
from fastpipe.storage import Remote, is_url


def staging_folder(url: str) -> Path:
    return default_cache_dir().parent / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def shard_to_url(cfg, shard, storage_options: dict | None = None):
    """Convert into the staging folder with `shard`, upload, then delete the staging folder."""
    url = str(cfg.out).rstrip("/")
    remote = Remote(url, storage_options)
    staging = staging_folder(url + cfg.suffix)  # the parts of a cluster job may share a node
    summary = shard(replace(cfg, out=staging))
    upload(staging, remote)
    shutil.rmtree(staging)
    summary.out = url
    summary.notes.append(f"uploaded to {url} (dataset{cfg.suffix}.json last); staging folder {staging} removed")
    return summary


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
    remote.get_many([(n, staging / n) for n in names])
    local = replace(cfg, train=[staging / n for n in names[: len(cfg.train)]],
                    val=[staging / n for n in names[len(cfg.train):]])
    index_shards(local)
    upload(staging, remote, skip=set(names))
    shutil.rmtree(staging)
    return load(prefix, storage_options)  # the manifest as the store now has it


def upload(folder: Path, remote: Remote, skip: set[str] = frozenset()) -> None:
    """Every file fastpipe wrote in `folder` (not its lock or journal, nor those in `skip`), the manifest
    (dataset.json, or a part's dataset.part-*.json) last."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder).as_posix() not in skip
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    last = [p for p in files if p.parent == folder and p.name.startswith("dataset") and p.suffix == ".json"]
    remote.put_many([(p, p.relative_to(folder).as_posix()) for p in files if p not in last])
    remote.put_many([(p, p.name) for p in last])


__all__ = ["index_to_url", "merge_to_url", "shard_to_url", "staging_folder", "upload"]

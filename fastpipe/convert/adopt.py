"""`fastpipe index URL/a.tar URL/b.tar ... [--out PLACE]`: foreign shards in a store indexed where they are. With
--out, in a store fastpipe need not write to (timm's `imagenet-1k-wds` on the Hugging Face Hub, a bucket of another
team), the manifest kept elsewhere: PLACE is a local folder or another store's folder. Without it, the `.idx`
files, previews, reader files and dataset.json go beside the shards, as a local index writes them.

No shard is downloaded whole: each is walked by its tar headers through `RangedFile` (a range from each header on,
which holds a sample's small members and the next header), its labels read there, and only the images drawn for
mean/std and the previews are fetched. In PLACE, dataset.json names the shards' folder (`settings.shards_at`) and
each shard by its name in it, and every reader takes the shards from there (dataset/loading.py). A shard's sha256
is the one the store lists (the Hub lists it for every LFS file); from a store that lists none, each shard is read
once, streamed through sha256 and not kept (`settings.sha256_from` says which).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastpipe.convert import previews, readers
from fastpipe.convert.foreign import (
    MAX_CLASSES,
    MAX_STATS_IMAGE,
    IndexConfig,
    _classes,
    _Scan,
    build,
    scan_entries,
    split_by_name,
    users_reader_files,
)
from fastpipe.convert.publish import staging_folder, upload
from fastpipe.dataset.loading import load
from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest, ShardInfo, save
from fastpipe.dataset.shardformat import entry_line, index_tar, write_index
from fastpipe.errors import ConfigError, DataError
from fastpipe.store import hub
from fastpipe.store.location import RangedFile, in_stores, place
from fastpipe.store.remote import Remote

HASH_PIECE = 8 << 20  # bytes per request when a shard is streamed through sha256
AT_ONCE = 16  # shards walked at a time (each walk is a chain of requests, a round trip each; Remote.inflight)


def index_where_they_are(cfg: IndexConfig, storage_options: dict | None = None) -> Manifest:
    """Index the shards named in `cfg` (all in one store folder) into `cfg.out`, or beside them without it; returns
    the manifest as read back."""
    urls = [str(u).rstrip("/") for u in [*cfg.train, *cfg.val]]
    prefix = urls[0].rsplit("/", 1)[0]
    if any(u.rsplit("/", 1)[0] != prefix for u in urls) or len(in_stores(urls)) < len(urls):
        raise ConfigError(f"shards in a store are indexed together when they are all in one folder (prefix)"
                          f"{'' if cfg.out else ', where dataset.json will go'}: {', '.join(urls[:3])}...")
    if prefix.startswith("hf://") and cfg.out:  # someone else's repository: the index describes it as it is now
        prefix = hub.pinned(prefix, storage_options or {})
    remote = Remote(prefix, storage_options)
    listed = {rel: (size, sha) for rel, size, sha in remote.listing(checksums=True)}
    names = [u.rsplit("/", 1)[1] for u in urls]
    missing = [n for n in names if n not in listed]
    if missing:
        raise ConfigError(f"{prefix}/{missing[0]}: no such shard ({len(missing)} of the {len(names)} named are not "
                          f"in the store's listing)")
    out_url = next(iter(in_stores([cfg.out], "--out")), None) if cfg.out else prefix
    out = _place(cfg, out_url, storage_options)
    train, val, note = split_by_name(names[: len(cfg.train)], names[len(cfg.train):])
    classes = _classes(cfg)
    limit = len(classes) if classes else MAX_CLASSES
    found: dict[int, list] = defaultdict(list)
    scans, shards = {}, {}
    for split, part, keep in (("train", train, cfg.stats_samples), ("val", val, 0)):
        scans[split], shards[split] = _walk(remote, part, listed, out, keep, limit, found)
    where = {"shards_at": prefix} if cfg.out else {}  # beside them, the shards are where dataset.json is
    manifest = build(cfg, classes, scans, shards, out, {**where, "sha256_from": _sha_source(listed, names),
                                                        **({"note": note} if note else {})})
    picked = previews._pick(found, manifest.classes, np.random.default_rng(0), 9)
    sheets = previews.draw(picked, manifest.classes, out / "previews",
                           lambda locs: remote.ranges([(rel, off, off + size) for rel, (off, size) in locs]))
    manifest.outputs["previews"] = {c: f"previews/{f}" for c, f in sheets.items()}
    if not cfg.out:  # the reader files of a set in its own folder, as a local index writes them; the user's kept
        manifest.outputs["readers"] = readers.write(manifest, out, keep=set(users_reader_files(remote)))
    save(manifest, out)
    if out_url:
        upload(out, Remote(out_url, storage_options))
        shutil.rmtree(out)
    return load(out_url or out, storage_options)


def _place(cfg: IndexConfig, out_url: str | None, storage_options: dict | None) -> Path:
    """The local folder the manifest is written in (the staging folder of a store's), refused when it would
    replace a data set without --overwrite."""
    if out_url:
        store = Remote(out_url, storage_options)
        store.check_writable()  # before the walk, which may take long: a refused write is said at once
        taken = store.exists(MANIFEST_NAME)
        out = staging_folder(out_url + "#index")
        shutil.rmtree(out, ignore_errors=True)
    else:
        out = place(cfg.out, "--out")
        taken = (out / MANIFEST_NAME).exists()
    if taken and not cfg.overwrite:
        raise ConfigError(f"{out_url or cfg.out}/{MANIFEST_NAME} already describes a data set; `fastpipe index` "
                          f"would replace it: add --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _walk(remote: Remote, names: list[str], listed: dict, out: Path, keep: int, limit: int, found) -> tuple:
    """Each shard of a split walked by its headers (AT_ONCE at a time), checked as a local one is; its .idx
    written into `out`. Returns the split's scan and shard list."""
    bar = tqdm(total=sum(listed[n][0] for n in names), desc="indexing", unit="B", unit_scale=True, leave=False)

    def headers(name: str):
        size, sha = listed[name]
        fh = RangedFile(remote, name, size, progress=bar.update)  # a shard's walk takes a while: bytes walked
        entries = index_tar(fh.name, fileobj=fh, size=size)
        if not entries:
            raise DataError(f"{fh.name} holds no samples (an empty or image-less tar): leave it out of the command")
        return name, fh, entries, sha or _streamed_sha256(remote, name, size)

    scan, infos, for_stats = _Scan(), [], []
    with ThreadPoolExecutor(AT_ONCE) as pool, bar:
        for name, fh, entries, sha in pool.map(headers, names):
            for (key, _), (label, image) in zip(entries, scan_entries(fh.name, fh, entries, 0, scan, limit)):
                found[label].append((name, image))
                if len(for_stats) < keep and image[1] <= MAX_STATS_IMAGE:
                    for_stats.append((f"{name}/{key}", name, image))
            index = f"{Path(name).stem}.idx"
            write_index(out / index, [entry_line(k, p) for k, p in entries])
            infos.append(ShardInfo(name, len(entries), listed[name][0], sha, index))
    # the first `keep` images, as a local index takes them, fetched together (not one round trip each)
    datas = remote.ranges([(name, off, off + size) for _, name, (off, size) in for_stats]) if for_stats else []
    scan.images = [(where, data) for (where, _, _), data in zip(for_stats, datas)]
    return scan, infos


def index_only_where_they_are(urls: list[str], storage_options: dict | None = None) -> int:
    """`fastpipe index --idx-only URL/a.tar ...`: each shard's .idx from a walk of its tar headers, uploaded beside
    it (nothing else is written, the shard is not downloaded). Returns the samples indexed."""
    total, folders = 0, defaultdict(list)
    for url in urls:
        prefix, name = url.rstrip("/").rsplit("/", 1)
        folders[prefix].append(name)
    with tempfile.TemporaryDirectory(prefix="fastpipe-idx-") as tmp:
        for prefix, names in folders.items():
            remote = Remote(prefix, storage_options)
            sizes, written = dict(remote.listing()), []
            for name in names:
                if name not in sizes:
                    raise ConfigError(f"{prefix}/{name}: no such shard (not in the store's listing)")
                fh = RangedFile(remote, name, sizes[name])
                entries = index_tar(fh.name, fileobj=fh, size=sizes[name])
                written.append(Path(tmp) / f"{Path(name).stem}.idx")
                write_index(written[-1], [entry_line(k, p) for k, p in entries])
                total += len(entries)
            upload(Path(tmp), remote)  # one commit on the Hub
            for p in written:
                p.unlink()
    return total


def _streamed_sha256(remote: Remote, name: str, size: int) -> str:
    h = hashlib.sha256()
    for start in range(0, size, HASH_PIECE):
        h.update(remote.ranges([(name, start, min(size, start + HASH_PIECE))])[0])
    return h.hexdigest()


def _sha_source(listed: dict, names: list[str]) -> str:
    return "the store's listing" if all(listed[n][1] for n in names) else "each shard read once"


__all__ = ["index_only_where_they_are", "index_where_they_are"]

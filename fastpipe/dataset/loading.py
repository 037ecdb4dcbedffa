"""Opening a data set: its dataset.json from its location (store/location.open_location: a folder or a store),
checked (manifest.from_dict), with the location attached as what reads its files: a store's with this node's shard
cache, and for a set whose shards are elsewhere (`fastpipe index URL/*.tar --out FOLDER`: shards in a repository the
user cannot write) an Overlay that reads the shards from their store and the rest from here.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest, ManifestError, from_dict
from fastpipe.errors import ConfigError
from fastpipe.store.location import node_cache, open_location, shards_elsewhere
from fastpipe.store.remote import RemoteError
from fastpipe.util import JSON_LIMIT, parse_json


def load(folder: str | os.PathLike, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
         cache_limit: int | str | None = None) -> Manifest:
    """Read OUT/dataset.json (or a path to the file itself) with errors that say what to do. OUT may be a URL
    (s3://, gs://, az://, http(s)://, hf://...): its shards are then read through a node-local cache (cache.py) in
    `cache_dir` (default ~/.cache/fastpipe/shards or $FASTPIPE_CACHE), kept under `cache_limit` ("50GB")."""
    text, name = os.fspath(folder) or ".", MANIFEST_NAME
    cache = lambda: node_cache(cache_dir, cache_limit)  # noqa: E731 (made for a store only: it creates a folder)
    where = open_location(text, storage_options, cache=cache, what="data set")
    if where.folder is not None and where.folder.is_file():  # the manifest itself, by whatever name
        where, name = open_location(where.folder.parent), where.folder.name
    elif where.folder is None and where.url.endswith("/" + MANIFEST_NAME):
        where = open_location(where.url[: -len(MANIFEST_NAME) - 1], storage_options, cache=cache)
    m = _read(where, name)
    shards_at = m.settings.get("shards_at")
    return m if shards_at is None else _shards_elsewhere(m, shards_at, storage_options, cache)


def _read(where, name: str = MANIFEST_NAME) -> Manifest:
    """dataset.json (or `name`) at a location, checked; a local folder with photos and no dataset.json is named as
    such."""
    try:
        data = where.cat(name, JSON_LIMIT)
    except RemoteError as e:
        if where.folder is None:
            raise  # names the URL and what the store said
        if isinstance(e.__cause__, FileNotFoundError):
            raise ManifestError(_missing(where.folder)) from None
        raise ManifestError(f"{where.join(name)} is damaged ({e.__cause__}); re-run the conversion") from e
    try:
        d = parse_json(data)
    except ValueError as e:  # JSON, UTF-8, nesting
        raise ManifestError(f"{where.join(name)} is damaged ({type(e).__name__}: {e}); re-run the conversion"
                            ) from e
    if where.folder is not None:
        return replace(from_dict(d, where.folder), files=where)
    return replace(from_dict(d, where.cache.folder, where.url), files=where)


def _missing(folder: Path) -> str:
    if folder.is_dir() and any(folder.iterdir()):  # the photos themselves, most likely: never shard into them
        out = f"{str(folder).rstrip('/')}-shards"
        return (f"{folder} holds no dataset.json: if it holds your photos, convert them into a new folder first, "
                f"`fastpipe shard {folder} {out}`, and use {out}; for shards written by another tool: "
                f"`fastpipe index SHARDS...`")
    return (f"{folder / MANIFEST_NAME} not found: run `fastpipe shard SRC {folder}` first, or `fastpipe index "
            f"SHARDS...` for shards written by another tool")


def _shards_elsewhere(m: Manifest, shards_at, storage_options, cache) -> Manifest:
    """The shards from the store `shards_at` names (through this node's cache), everything else from the manifest's
    own location (location.shards_elsewhere says which stores a manifest may point at)."""
    paths = {s.path for sp in m.splits.values() for s in sp.shards}
    try:
        return replace(m, files=shards_elsewhere(m.files, shards_at, paths, storage_options, cache))
    except ConfigError as e:
        raise ManifestError(f"{m.location}/{MANIFEST_NAME}: {e}") from None


__all__ = ["load"]

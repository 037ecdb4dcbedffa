"""Opening a data set: its dataset.json from a folder or a store, checked (manifest.from_dict), with what reads its
files attached: nothing for a local set (its files are paths), the store's client and this node's shard cache for
a set in a store, and for a set whose shards are elsewhere (`fastpipe index URL/*.tar --out FOLDER`: shards in a
repository the user cannot write) a location that reads the shards from their store and the rest from here.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest, ManifestError, from_dict
from fastpipe.errors import ConfigError
from fastpipe.store import cachefiles
from fastpipe.store.cache import default_cache_dir
from fastpipe.store.location import Folder, Overlay
from fastpipe.store.remote import Remote, is_url
from fastpipe.store.urls import check_url, local_path, redact
from fastpipe.util import parse_json, read_json


def load(folder: str | os.PathLike, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None,
         cache_limit: int | str | None = None) -> Manifest:
    """Read OUT/dataset.json (or a path to the file itself) with errors that say what to do. OUT may be a URL
    (s3://, gs://, az://, http(s)://, hf://...): its shards are then read through a node-local cache (cache.py) in
    `cache_dir` (default ~/.cache/fastpipe/shards or $FASTPIPE_CACHE), kept under `cache_limit` ("50GB")."""
    if is_url(os.fspath(folder)):
        m = load_remote(os.fspath(folder), storage_options, cache_dir, cache_limit)
    else:
        m = _load_local(folder)
    shards_at = m.settings.get("shards_at")
    return m if shards_at is None else _shards_elsewhere(m, shards_at, storage_options, cache_dir, cache_limit)


def _load_local(folder) -> Manifest:
    path = local_path(folder, "data set")
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.exists():
        folder = path.parent
        if folder.is_dir() and any(folder.iterdir()):  # the photos themselves, most likely: never shard into them
            out = f"{str(folder).rstrip('/')}-shards"
            raise ManifestError(f"{folder} holds no dataset.json: if it holds your photos, convert them into a new "
                                f"folder first, `fastpipe shard {folder} {out}`, and use {out}; for shards written by "
                                f"another tool: `fastpipe index SHARDS...`")
        raise ManifestError(f"{path} not found: run `fastpipe shard SRC {folder}` first, "
                            f"or `fastpipe index SHARDS...` for shards written by another tool")
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:  # ValueError: JSON, UTF-8, size (DataError), nesting
        raise ManifestError(f"{path} is damaged ({type(e).__name__}: {e}); re-run the conversion") from e
    return from_dict(data, path.parent)


def load_remote(url: str, storage_options: dict | None, cache_dir, cache_limit) -> Manifest:
    """A data set in a store: its dataset.json, checked as a local one is (errors name its URL), with the store's
    client attached, this node's cache folder (private to its user: cachefiles) and the cache's size limit ("50GB";
    None: no limit). The URL is checked before anything is created."""
    url = url.rstrip("/")
    url = url[: -len(MANIFEST_NAME) - 1] if url.endswith("/" + MANIFEST_NAME) else url
    remote = _remote(url, storage_options, cache_dir, cache_limit)
    data = remote.cat(MANIFEST_NAME)  # a missing one: RemoteError naming the URL
    try:
        d = parse_json(data)
    except ValueError as e:  # JSON, UTF-8, nesting
        raise ManifestError(f"{url}/{MANIFEST_NAME} is damaged ({type(e).__name__}: {e}); re-run the conversion"
                            ) from e
    return replace(from_dict(d, remote.cache_dir, url), remote=remote)


def _remote(url: str, storage_options: dict | None, cache_dir, cache_limit) -> Remote:
    from fastpipe.options import parse_size

    limit = parse_size(cache_limit, bare="GB") if cache_limit not in (None, "", 0) else None
    remote = Remote(url, storage_options, cache_limit=limit)
    remote.cache_dir = cachefiles.private_folder(Path(cache_dir) if cache_dir else default_cache_dir())
    return remote


def _shards_elsewhere(m: Manifest, shards_at, storage_options, cache_dir, cache_limit) -> Manifest:
    """The shards from the store `shards_at` names (through this node's cache), everything else from the manifest's
    own place. `storage_options` go with the shards' requests only when the manifest is local or in the same
    origin (scheme and host or bucket): otherwise the shards' store is reached with its environment's credentials."""
    try:
        url = check_url(shards_at, "settings.shards_at") if isinstance(shards_at, str) and is_url(shards_at) else None
    except ConfigError as e:
        raise ManifestError(f"{m.location}/{MANIFEST_NAME}: {e}") from None
    if url is None:
        raise ManifestError(f"{m.location}/{MANIFEST_NAME}: settings.shards_at should be the URL of the shards' "
                            f"folder (holds {redact(str(shards_at))[:80]!r}); re-run `fastpipe index`")
    ours = _origin(m.remote.url) if m.remote is not None else None
    if ours and (_origin(url)[0] != ours[0] or (ours[0] in ("http", "https", "file") and _origin(url) != ours)):
        # a manifest from a store must not make this machine read its local files or another host's addresses
        raise ManifestError(f"{m.location}/{MANIFEST_NAME}: settings.shards_at {redact(url)} is not in the same "
                            f"kind of store as the manifest ({m.remote.protocol}://), or not on its host; an index "
                            f"of shards elsewhere is kept beside them or on this machine: re-run `fastpipe index`")
    if ours and _origin(url) != ours:
        storage_options = None  # a manifest from a store does not get to send our options (headers, keys) elsewhere
    shards = _remote(url.rstrip("/"), storage_options, cache_dir, cache_limit)
    own = m.remote if m.remote is not None else Folder(m.root)
    paths = {s.path for sp in m.splits.values() for s in sp.shards}
    return replace(m, remote=Overlay(own, shards, paths))


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


__all__ = ["load", "load_remote"]

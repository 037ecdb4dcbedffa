"""A data set in a store: its dataset.json read through the store's client (store.remote), checked as a local one is,
and attached to this node's shard cache (store.cache)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest, ManifestError, from_dict
from fastpipe.store import cachefiles
from fastpipe.store.cache import default_cache_dir
from fastpipe.store.remote import Remote
from fastpipe.util import parse_json


def load_remote(url: str, storage_options: dict | None, cache_dir, cache_limit) -> Manifest:
    """A data set in a store: its dataset.json, checked as a local one is (errors name its URL), with the store's
    client attached, this node's cache folder (private to its user: cachefiles) and the cache's size limit ("50GB";
    None: no limit). The URL is checked before anything is created."""
    from fastpipe.options import parse_size

    url = url.rstrip("/")
    url = url[: -len(MANIFEST_NAME) - 1] if url.endswith("/" + MANIFEST_NAME) else url
    limit = parse_size(cache_limit, bare="GB") if cache_limit not in (None, "", 0) else None
    remote = Remote(url, storage_options, cache_limit=limit)
    remote.cache_dir = cachefiles.private_folder(Path(cache_dir) if cache_dir else default_cache_dir())
    data = remote.cat(MANIFEST_NAME)  # a missing one: RemoteError naming the URL
    try:
        d = parse_json(data)
    except ValueError as e:  # JSON, UTF-8, nesting
        raise ManifestError(f"{url}/{MANIFEST_NAME} is damaged ({type(e).__name__}: {e}); re-run the conversion"
                            ) from e
    return replace(from_dict(d, remote.cache_dir, url), remote=remote)

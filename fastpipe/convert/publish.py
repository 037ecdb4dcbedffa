"""`fastpipe shard SRC s3://bucket/prefix`: a conversion written into object storage.

The conversion runs into a staging folder on this node (beside the shard cache), exactly as a local one (resumable,
byte-deterministic), and is then uploaded: every shard, index, preview and rejection record first, several at a
time, and `dataset.json` last, so a reader never finds a manifest whose shards are not all there. Each object is
one PUT, complete or absent. The staging folder is deleted once the upload is complete; an interrupted run keeps
it, and running the same command again resumes there and uploads again (the same bytes).

Left out, deliberately: the journal is kept on this node, not in the bucket (a lost machine restarts the
conversion, with the same result); `--parts` with a URL and `fastpipe merge URL` (run the parts into local
folders, merge, then upload the merged folder with `fastpipe shard` or the store's own sync).
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

from fastpipe.cache import default_cache_dir
from fastpipe.errors import ConfigError
from fastpipe.manifest import MANIFEST_NAME
from fastpipe.storage import Remote


def staging_folder(url: str) -> Path:
    return default_cache_dir().parent / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def shard_to_url(cfg, shard, storage_options: dict | None = None):
    """Convert into the staging folder with `shard`, upload, then delete the staging folder."""
    url = str(cfg.out).rstrip("/")
    if cfg.parts != 1:
        raise ConfigError(f"--parts with OUT {url}: convert the parts into local folders, `fastpipe merge` them, then "
                          f"upload the merged folder (`fastpipe shard` of a URL writes whole conversions)")
    remote = Remote(url, storage_options)
    staging = staging_folder(url)
    summary = shard(replace(cfg, out=staging))
    upload(staging, remote)
    shutil.rmtree(staging)
    summary.out = url
    summary.notes.append(f"uploaded to {url} (dataset.json last); staging folder {staging} removed")
    return summary


def upload(folder: Path, remote: Remote) -> None:
    """Every file fastpipe wrote in `folder` (not its lock or journal), dataset.json last."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(folder).parts)]
    manifest = folder / MANIFEST_NAME
    rest = [p for p in files if p != manifest]
    remote.put_many([(p, p.relative_to(folder).as_posix()) for p in rest])
    remote.put_many([(manifest, MANIFEST_NAME)])


__all__ = ["shard_to_url", "staging_folder", "upload"]

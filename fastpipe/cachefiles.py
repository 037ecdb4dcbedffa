"""The node cache's files (cache.py): sparse shard files created atomically, byte-range locks between the
processes of a node, recency for eviction, stamps of a checked shard, and each shard's `.idx` kept beside it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path

from fastpipe.storage import Remote


def cached_indexes(remote: Remote, folder: Path, rels: list[str], sha256s: list[str]) -> tuple[list[bytes], list[bool]]:
    """The shards' `.idx` files: this node's copy where it has one, the others fetched together. (texts, which
    came from the cache.) A copy is named by its shard's sha256, like the shard: an index is a function of its
    shard's bytes, so a changed shard never meets an old copy, and a restarted job asks the store for dataset.json
    only. The caller checks every copy as it checks a fetched index; `keep_index` stores the fetched ones."""
    texts: list = [None] * len(rels)
    for i, sha in enumerate(sha256s):
        with contextlib.suppress(OSError):
            texts[i] = (Path(folder) / f"{sha}.idx").read_bytes()
    todo = [i for i, t in enumerate(texts) if t is None]
    for i, text in zip(todo, remote.cat_many([rels[i] for i in todo]) if todo else []):
        texts[i] = text
    fetched = set(todo)
    return texts, [i not in fetched for i in range(len(rels))]


def keep_index(folder: Path, sha256: str, text: bytes) -> None:
    """Store a checked `.idx` beside its shard (atomically: ranks of a node may write it at once). Not synced: a
    copy damaged by a crash fails its check and is fetched again. A cache that cannot be written costs a refetch."""
    path = Path(folder) / f"{sha256}.idx"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def create_sparse(path: Path, size: int) -> None:
    """A sparse file of `size` zero bytes, created atomically (another process may be creating the same one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def try_lock(fd: int, start: int, end: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, end - start, start)
        return True
    except OSError:
        return False


def unlock(fd: int, start: int, end: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, end - start, start)


def touch(path: Path) -> None:
    """Recency for eviction is the access time, set explicitly (mounts with relatime don't): mtime is left alone,
    since the stamp compares it."""
    try:
        st = path.stat()
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except FileNotFoundError:
        pass


def stamp_path(path: Path) -> Path:
    return path.with_suffix(".ok")


def stamped(path: Path) -> bool:
    try:
        return stamp_path(path).read_text() == str(path.stat().st_mtime_ns)
    except (FileNotFoundError, ValueError):
        return False


def stamp(path: Path) -> None:
    tmp = stamp_path(path).with_name(f".{path.stem}.ok.{os.getpid()}")
    tmp.write_text(str(path.stat().st_mtime_ns))
    tmp.replace(stamp_path(path))


__all__ = ["cached_indexes", "create_sparse", "keep_index", "stamp", "stamp_path", "stamped", "touch", "try_lock",
           "unlock"]

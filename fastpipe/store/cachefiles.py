"""The node cache's files (cache.py): sparse shard files created atomically, byte-range locks between the
processes of a node, recency for eviction, stamps of a checked shard, and each shard's `.idx` kept beside it.

The cache lives in a folder private to its user: a shard's cache name is its sha256, public in dataset.json, so in a
folder others can write, another user could plant a link under that name and have this user's job write a shard's
bytes through it (over their files). `private_folder` gives each user a folder of their own (0700) below a shared
root, and refuses one that is not theirs; every cache file is opened without following links and checked to be a
regular file of this user's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import os
import stat
import threading
import time
from pathlib import Path

from fastpipe.errors import DataError
from fastpipe.store.remote import Remote


class CacheNotPrivate(DataError):
    """A cache folder or file that is not this user's own (a link, another user's file, a folder others can write)."""


def private_folder(folder: Path) -> Path:
    """`folder` if this user owns it and no one else can write there; below a folder others can write (a shared
    scratch root such as /scratch/fp), a folder of this user's own inside it. Created 0700 when missing."""
    folder = Path(folder).expanduser().absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = folder.stat()  # through a link the user made, as ~/.cache often is: ownership is checked on the target
    if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
        return folder
    if st.st_mode & 0o022 and stat.S_ISDIR(st.st_mode):  # shared: each user a folder of their own below it
        own = folder / f"{_user()}-{os.geteuid()}"
        with contextlib.suppress(FileExistsError):
            own.mkdir(mode=0o700)
        st = os.lstat(own)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return own
        folder = own
    raise CacheNotPrivate(f"cache folder {folder} is not private to this user (owner uid {st.st_uid}, mode "
                          f"{stat.filemode(st.st_mode)}; this user is uid {os.geteuid()}): another user could read "
                          f"or replace its files. Remove it, or choose another --cache-dir / $FASTPIPE_CACHE")


def _user() -> str:
    try:
        return "".join(c for c in getpass.getuser() if c.isalnum() or c in "._-") or "user"
    except (KeyError, OSError):  # no name for this uid (containers)
        return "user"


def open_own(path: Path, flags: int, mode: int = 0o600) -> int:
    """A file descriptor for a cache file: never through a link, and only a regular file of this user's."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the name is a link
            raise CacheNotPrivate(f"{path} is a link, which fastpipe did not make: not followed. Remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise CacheNotPrivate(f"{path} is not a regular file of this user's (owner uid {st.st_uid}, "
                              f"{stat.filemode(st.st_mode)}): not used. Remove it")
    return fd


def read_own(path: Path) -> bytes:
    fd = open_own(path, os.O_RDONLY)
    with open(fd, "rb") as f:
        return f.read()


def cached_indexes(remote: Remote, folder: Path, rels: list[str], sha256s: list[str]) -> tuple[list[bytes], list[bool]]:
    """The shards' `.idx` files: this node's copy where it has one, the others fetched together. (texts, which
    came from the cache.) A copy is named by its shard's sha256, like the shard: an index is a function of its
    shard's bytes, so a changed shard never meets an old copy, and a restarted job asks the store for dataset.json
    only. The caller checks every copy as it checks a fetched index; `keep_index` stores the fetched ones."""
    texts: list = [None] * len(rels)
    for i, sha in enumerate(sha256s):
        with contextlib.suppress(OSError):  # a missing copy (CacheNotPrivate is not an OSError: it stops the run)
            texts[i] = read_own(Path(folder) / f"{sha}.idx")
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
        tmp.unlink(missing_ok=True)
        with open(open_own(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY), "wb") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def create_sparse(path: Path, size: int) -> None:
    """A sparse file of `size` zero bytes, created atomically (another process may be creating the same one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
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
        st = path.lstat()
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns), follow_symlinks=False)
    except FileNotFoundError:
        pass


def stamp_path(path: Path) -> Path:
    return path.with_suffix(".ok")


def stamped(path: Path) -> bool:
    try:
        return read_own(stamp_path(path)).decode() == str(path.lstat().st_mtime_ns)
    except (FileNotFoundError, ValueError):
        return False


def stamp(path: Path) -> None:
    tmp = stamp_path(path).with_name(f".{path.stem}.ok.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = open_own(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with open(fd, "w") as f:
        f.write(str(path.lstat().st_mtime_ns))
    tmp.replace(stamp_path(path))


__all__ = ["CacheNotPrivate", "cached_indexes", "create_sparse", "keep_index", "open_own", "private_folder",
           "read_own", "stamp", "stamp_path", "stamped", "touch", "try_lock", "unlock"]

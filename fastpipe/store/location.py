"""Locations: where a data set, SRC or OUT is. `open_location(path_or_url)` is the one place that tells a local
folder from a store: it returns a `Folder` (a folder on this machine) or a `Remote` (a store folder: s3, gs, az,
http(s), hf), which answer the same calls (join, relative, cat, cat_many, ranges, exists, listing, glob, delete,
put_many, get_many, check_writable, counters). `Overlay` is a data set whose shards are in one place and whose own
files (dataset.json, `.idx` files, previews) in another: foreign shards indexed where they are (`fastpipe index
hf://datasets/ORG/NAME/*.tar --out FOLDER`), in a repository the user cannot write to.

The node cache is a layer a store location has (`NodeCache`, given when it is opened): the loaders read a
location's shards through it when it has one, and a folder's shards in place.
"""

from __future__ import annotations

import bisect
import io
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fastpipe.errors import ConfigError, DataError
from fastpipe.store.remote import SMALL_OBJECT, Counters, Remote, RemoteError, is_url
from fastpipe.store.urls import check_url, local_path, redact
from fastpipe.util import FileTooLarge, NotRegularFile, read_regular


@dataclass(frozen=True)
class NodeCache:
    """Where this node keeps the shards it reads from a store (a folder private to its user: cachefiles), and the
    bytes it may hold (None: no limit)."""

    folder: Path
    limit: int | None = None


def node_cache(cache_dir=None, cache_limit: int | str | None = None) -> NodeCache:
    """The cache settings as the API and the CLI take them: a folder (default ~/.cache/fastpipe/shards or
    $FASTPIPE_CACHE) and a size ("50GB", a number of GB); the folder is made private to this user here."""
    from fastpipe.options import parse_size
    from fastpipe.store import cachefiles
    from fastpipe.store.cache import default_cache_dir

    limit = parse_size(cache_limit, bare="GB") if cache_limit not in (None, "", 0) else None
    return NodeCache(cachefiles.private_folder(Path(cache_dir) if cache_dir else default_cache_dir()), limit)


def open_location(where, storage_options: dict | None = None, *, cache=None, what: str = "data set"
                  ) -> Folder | Remote:
    """The location `where` names: a store folder for a URL (checked: urls.check_url), else a local folder (a
    path as urls.local_path allows). `cache`: the NodeCache a store's reads go through (or a function making it,
    called for a store only). `what` names it in messages ("SRC", "OUT")."""
    text = os.fspath(where) if isinstance(where, os.PathLike) else where
    if is_url(text):
        url = check_url(text, what).rstrip("/")
        return Remote(url, storage_options, cache=cache() if callable(cache) else cache)
    return Folder(local_path(text, what))


def shards_elsewhere(own, shards_at, paths: set[str], storage_options: dict | None, cache) -> Overlay:
    """A data set's location whose shards (`paths`) are read from the store folder `shards_at`. A manifest in a
    store may point only at the same kind of store (for http and file, the same host): it must not make this
    machine read its local files or another host's addresses. `storage_options` go with the shards' requests only
    when the manifest is local or in the same origin (scheme and host or bucket): a manifest from a store does not
    get to send our options (headers, keys) elsewhere. Raises ConfigError naming the problem."""
    if not (isinstance(shards_at, str) and is_url(shards_at)):
        raise ConfigError(f"settings.shards_at should be the URL of the shards' folder (holds "
                          f"{redact(str(shards_at))[:80]!r}); re-run `fastpipe index`")
    url = check_url(shards_at, "settings.shards_at").rstrip("/")
    ours = None if own.folder is not None else _origin(own.url)
    if ours and (_origin(url)[0] != ours[0] or (ours[0] in ("http", "https", "file") and _origin(url) != ours)):
        raise ConfigError(f"settings.shards_at {redact(url)} is not in the same kind of store as the manifest "
                          f"({own.protocol}://), or not on its host; an index of shards elsewhere is kept beside "
                          f"them or on this machine: re-run `fastpipe index`")
    options = None if ours and _origin(url) != ours else storage_options
    return Overlay(own, Remote(url, options, cache=cache() if callable(cache) else cache), paths)


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def in_stores(paths, what: str = "shard") -> list[str]:
    """The URLs among `paths` (each checked as open_location checks it)."""
    found = [open_location(p, what=what) for p in paths]
    return [f.url for f in found if f.folder is None]


def place(where, what: str = "data set") -> str | Path:
    """What a setting that names a location holds once checked: its URL (checked) or its local Path."""
    loc = open_location(where, what=what)
    return loc.url if loc.folder is None else loc.folder


class Folder:
    """A local folder, read and written through the same calls as a store folder."""

    protocol = "file"
    cache = None  # read in place: no node cache in between
    inflight = 1  # reads at once that its latency calls for (a store's: Remote.inflight)

    def __init__(self, root: str | os.PathLike):
        self.root = self.folder = Path(root)
        self.url = str(self.root)
        self.counters = Counters()

    def __repr__(self) -> str:
        return f"Folder({self.url!r})"

    @property
    def identity(self) -> str:
        """What names this location in records and cache keys: the folder's absolute path (a store's: its URL)."""
        return str(self.root.resolve())

    def join(self, rel: str) -> str:
        """The path of a file in this folder: `rel` relative, without '..' (any name a disk holds, unlike a URL)."""
        if not rel or rel.startswith("/") or ".." in rel.split("/") or "\x00" in rel:
            raise ConfigError(f"{rel!r}: expected a path inside {self.root} (relative, no '..')")
        return str(self.root / rel)

    def relative(self, where: str) -> str:
        """The name inside this folder of one of its files' paths (join's inverse)."""
        return Path(where).relative_to(self.root).as_posix()

    def cat(self, rel: str, limit: int = SMALL_OBJECT) -> bytes:
        """A whole file of at most `limit` bytes, a regular file only. What cannot be read is a RemoteError whose
        cause says why (FileNotFoundError, util.FileTooLarge, util.NotRegularFile, another OSError), as a store's."""
        where = self.join(rel)
        try:
            return read_regular(Path(where), limit)
        except FileNotFoundError as e:
            raise RemoteError(f"{where} not found") from e
        except (OSError, FileTooLarge, NotRegularFile) as e:
            raise RemoteError(str(e) if isinstance(e, DataError) else f"{where}: {e}") from e

    def cat_many(self, rels: list[str], limit: int = SMALL_OBJECT) -> list[bytes]:
        return [self.cat(rel, limit) for rel in rels]

    def ranges(self, parts: list[tuple[str, int, int]]) -> list[bytes]:
        out = []
        for rel, start, end in parts:
            with open(self.join(rel), "rb") as fh:
                fh.seek(start)
                data = fh.read(end - start)
            if len(data) != end - start:
                raise DataError(f"{self.join(rel)}: asked for bytes {start}-{end - 1}, the file is shorter")
            out.append(data)
        return out

    def exists(self, rel: str) -> bool:
        return Path(self.join(rel)).is_file()

    def listing(self, checksums: bool = False) -> list[tuple]:
        """(path relative to this folder, size[, None]) of every regular file below it (links not followed)."""
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                p = Path(dirpath) / name
                if p.is_file() and not p.is_symlink():
                    out.append((p.relative_to(self.root).as_posix(), p.stat().st_size, *((None,) * checksums)))
        return sorted(out)

    def glob(self, pattern: str) -> list[str]:
        return sorted(p.name for p in self.root.glob(pattern) if p.is_file())

    def delete(self, rel: str) -> None:
        Path(self.join(rel)).unlink(missing_ok=True)

    def check_writable(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def get_many(self, files: list[tuple[str, os.PathLike]]) -> None:
        for rel, local in files:
            shutil.copyfile(self.join(rel), local)

    def put_many(self, files: list[tuple[os.PathLike, str]]) -> None:
        for local, rel in files:
            target = Path(self.join(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")  # O_EXCL: no planted link
            try:
                with os.fdopen(fd, "wb") as out, open(local, "rb") as src:
                    shutil.copyfileobj(src, out)
                os.replace(part, target)
            except BaseException:
                Path(part).unlink(missing_ok=True)
                raise

    def without_credentials(self) -> Folder:
        return self


class Overlay:
    """The shards (`paths`, relative to `shards`' folder) from `shards`; every other file from `own`. Counted,
    cached and named as the shards' store: that is where the traffic goes."""

    def __init__(self, own: Folder | Remote, shards: Remote, paths: set[str]):
        self.own, self.shards, self.paths = own, shards, frozenset(paths)

    def __repr__(self) -> str:
        return f"Overlay({self.own.url!r}, shards from {self.shards.url!r})"

    @property
    def folder(self) -> Path | None:
        """The index's own folder where it is on this machine (an index rewritten in place, under its lock)."""
        return self.own.folder

    @property
    def identity(self) -> str:
        return self.own.identity

    def get_many(self, files: list[tuple[str, os.PathLike]]) -> None:
        for rel, local in files:
            self._of(rel).get_many([(rel, local)])

    def put_many(self, files: list[tuple[os.PathLike, str]]) -> None:
        """The index's own files only: the shards' store is someone else's, and is never written."""
        theirs = [rel for _, rel in files if rel in self.paths]
        if theirs:
            raise ConfigError(f"{self.shards.join(theirs[0])}: a shard of the store the index points at; fastpipe "
                              f"does not write there")
        self.own.put_many(files)

    @property
    def protocol(self) -> str:
        return self.shards.protocol

    @property
    def counters(self):
        return self.shards.counters

    @property
    def cache(self) -> NodeCache | None:
        return self.shards.cache

    @property
    def url(self) -> str:
        return self.own.url

    def _of(self, rel: str):
        return self.shards if rel in self.paths else self.own

    def join(self, rel: str) -> str:
        return self._of(rel).join(rel)

    def cat(self, rel: str, limit: int = SMALL_OBJECT) -> bytes:
        return self._of(rel).cat(rel, limit)

    def cat_many(self, rels: list[str], limit: int = SMALL_OBJECT) -> list[bytes]:
        out: dict[str, bytes] = {}
        for where in (self.own, self.shards):
            mine = [r for r in rels if self._of(r) is where]
            out.update(zip(mine, where.cat_many(mine, limit) if mine else []))
        return [out[r] for r in rels]

    def ranges(self, parts: list[tuple[str, int, int]]) -> list[bytes]:
        mine = [p for p in parts if p[0] in self.paths]
        out = dict(zip(range(len(mine)), self.shards.ranges(mine) if mine else []))
        rest = iter(self.own.ranges([p for p in parts if p[0] not in self.paths]) or [])
        it = iter(range(len(mine)))
        return [out[next(it)] if p[0] in self.paths else next(rest) for p in parts]

    def exists(self, rel: str) -> bool:
        return self._of(rel).exists(rel)

    def without_credentials(self) -> Overlay:
        return Overlay(self.own.without_credentials(), self.shards.without_credentials(), set(self.paths))


SEEN = 32 << 20  # bytes of small ranges a RangedFile keeps: a shard's sample headers and labels (8,000 samples)


class RangedFile(io.RawIOBase):
    """A read-only, seekable file over one object of a store, fetched by byte ranges of at least `ahead` bytes
    from where each read starts: `tarfile` walks a shard's member headers through it, and a sample's small members
    (.cls, .json) and the next header come with one request, while the images between are skipped."""

    def __init__(self, remote, rel: str, size: int, ahead: int = 4 << 10, progress=None):
        super().__init__()
        self.remote, self.rel, self.size, self.ahead = remote, rel, size, ahead
        self.progress, self.reached = progress, 0  # progress(n): n more bytes of the object walked past
        self.name = remote.join(rel)
        self.pos, self.start, self.buf = 0, 0, b""
        # the small ranges fetched so far, by start (a label is read after the walk), and their starts in order
        self.seen: dict[int, bytes] = {}
        self.starts: list[int] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, max(0, self.size - self.pos))
        if n == 0:
            return b""
        if not self.start <= self.pos or self.pos + n > self.start + len(self.buf):
            self.start, self.buf = self._fetch(n)
        data = self.buf[self.pos - self.start: self.pos - self.start + n]
        self.pos += len(data)
        return data

    def _fetch(self, n: int) -> tuple[int, bytes]:
        """A range that holds [pos, pos + n): one fetched before (the last SEEN of them), or a new one."""
        k = bisect.bisect_right(self.starts, self.pos) - 1  # the last range starting at or before pos
        if k >= 0 and self.pos + n <= self.starts[k] + len(self.seen[self.starts[k]]):
            return self.starts[k], self.seen[self.starts[k]]
        end = min(self.size, self.pos + max(n, self.ahead))
        buf = self.remote.ranges([(self.rel, self.pos, end)])[0]
        if self.progress is not None and end > self.reached:
            self.progress(end - self.reached)
            self.reached = end
        if len(buf) <= self.ahead and len(self.seen) * self.ahead < SEEN and self.pos not in self.seen:
            self.seen[self.pos] = buf
            bisect.insort(self.starts, self.pos)
        return self.pos, buf

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


__all__ = ["Folder", "NodeCache", "Overlay", "RangedFile", "in_stores", "node_cache", "open_location", "place",
           "shards_elsewhere"]

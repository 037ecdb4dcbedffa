"""Where a data set's files are read from, when that is not one store folder: `Folder`, a local folder read as a
store is (whole files and byte ranges, bounded), and `Overlay`, a data set whose shards are in one place and whose
own files (dataset.json, `.idx` files, previews) in another: foreign shards indexed where they are
(`fastpipe index hf://datasets/ORG/NAME/*.tar --out FOLDER`), in a repository the user cannot write to.

Both answer what readers ask a `Remote` (join, cat, cat_many, ranges, exists, counters, the cache settings), so that
the loaders, the cache and `inspect` take them as they take a store.
"""

from __future__ import annotations

import bisect
import io
import os
from pathlib import Path

from fastpipe.errors import DataError
from fastpipe.store.remote import SMALL_OBJECT, Counters, Remote
from fastpipe.store.urls import check_relative
from fastpipe.util import read_regular


class Folder:
    """A local folder, read through the same calls as a store folder."""

    protocol = "file"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = str(self.root)
        self.counters = Counters()

    def join(self, rel: str) -> str:
        return str(self.root / check_relative(rel, f"a path in {self.root}"))

    def cat(self, rel: str, limit: int = SMALL_OBJECT) -> bytes:
        try:
            return read_regular(Path(self.join(rel)), limit)
        except FileNotFoundError:
            raise DataError(f"{self.join(rel)} not found") from None

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

    def without_credentials(self) -> Folder:
        return self


class Overlay:
    """The shards (`paths`, relative to `shards`' folder) from `shards`; every other file from `own`. Counted,
    cached and named as the shards' store: that is where the traffic goes."""

    def __init__(self, own: Folder | Remote, shards: Remote, paths: set[str]):
        self.own, self.shards, self.paths = own, shards, frozenset(paths)

    def __repr__(self) -> str:
        return f"Overlay({self.own.url!r}, shards from {self.shards.url!r})"

    def __getattr__(self, name):  # url, protocol, counters, cache_dir, cache_limit, options, timeout: the shards'
        if name in ("own", "shards", "paths"):
            raise AttributeError(name)
        return getattr(self.shards, name)

    def __setattr__(self, name, value):
        if name in ("cache_dir", "cache_limit"):
            setattr(self.shards, name, value)
        else:
            object.__setattr__(self, name, value)

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


__all__ = ["Folder", "Overlay", "RangedFile"]

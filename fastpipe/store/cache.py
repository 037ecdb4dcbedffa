"""The node-local cache of remote shards: the reading layer of a data set in object storage.

A cached shard is one sparse file named by the shard's sha256 (so two URLs of the same shard share it, and a
changed shard is a new name): the shard's bytes at their own offsets, then one byte per sample saying whether that
sample's bytes are there. Readers map it exactly like a local shard (shards.py), so nothing after the cache knows
the data is remote. Only the samples asked for are fetched, as coalesced byte ranges (never a request per sample,
never the whole shard when a part is needed), several in flight.

Shared by every rank and worker of a node: a range is fetched under a POSIX byte-range lock on the file, taken
without waiting; a range another process is fetching is waited for afterwards and re-checked, so no two processes
download the same bytes at once and none deadlocks. A sample's presence byte is written after its bytes. When the
last sample of a shard arrives, the shard is checked against dataset.json's sha256 (a stamp file records the check,
for the file as it was then); a complete shard whose stamp is missing or older than the file is checked again
before use, and one that fails is deleted and fetched again. Shards least recently used are evicted whole when
the cache grows past its limit (a process that has one mapped keeps reading it; the disk space returns when it
lets go). Damage to a partly fetched shard is found when it completes; every fetched range's tar headers are
checked against the index as it arrives. The files themselves (locks, stamps, `.idx` copies): cachefiles.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import threading
import warnings
from pathlib import Path

import numpy as np

from fastpipe.errors import DataError, FastpipeWarning
from fastpipe.store import cachefiles
from fastpipe.store.remote import Remote

# Samples closer than GAP are fetched in one request: on a store, a request costs tens of ms of latency and a
# round of the concurrency limit, a MiB costs a few ms of bandwidth. Every sample inside a fetched range is
# marked present, so the other workers of the node find their samples of the same shuffle block already here.
GAP = 1 << 20
MAX_REQUEST = 16 << 20  # and no request larger, so that a large read still spreads over several connections


def default_cache_dir() -> Path:
    env = os.environ.get("FASTPIPE_CACHE")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(env) if env else base / "fastpipe" / "shards"


def coalesce(spans: np.ndarray, gap: int = GAP, largest: int = MAX_REQUEST) -> list[tuple[int, int, np.ndarray]]:
    """Merge sample spans (rows of start, end, sorted by start) into requests: (start, end, rows covered)."""
    out, rows = [], []
    start = end = -1
    for r, (s, e) in enumerate(spans.tolist()):
        if rows and s - end <= gap and e - start <= largest:
            end = max(end, e)
            rows.append(r)
            continue
        if rows:
            out.append((start, end, np.array(rows)))
        start, end, rows = s, e, [r]
    if rows:
        out.append((start, end, np.array(rows)))
    return out


def tiling(ends: np.ndarray, shard_bytes: int) -> np.ndarray:
    """Each sample's span in its shard, from the end of the previous sample's members (tar headers included) to
    the end of its own, the last to the end of the shard: the spans tile it, so a shard whose samples are all
    present is all there. `ends`: where each sample's last member ends, in file order."""
    bounds = np.concatenate([[0], ends[:-1], [shard_bytes]]) if len(ends) else np.array([0, 0])
    return np.stack([bounds[:-1], bounds[1:]], 1).astype(np.int64)


class ShardCache:
    """Cached copies of one split's remote shards. `spans[i]` holds each sample's [start, end) in shard i."""

    def __init__(self, remote: Remote, folder: Path, limit: int | None, rel_paths: list[str], sizes: list[int],
                 sha256s: list[str], spans: list[np.ndarray], heads: list[np.ndarray], as_indexed):
        self.remote, self.folder, self.limit = remote, Path(folder), limit
        self.rel, self.sizes, self.sha, self.spans = rel_paths, sizes, sha256s, spans
        self.heads = heads  # per shard, each sample's image member: (its header's offset, its size), as indexed
        # as_indexed(range bytes, range start, heads): the shard format's check that the tar headers in a fetched
        # range are where the index says (dataset.shardformat.range_as_indexed); the cache itself knows no tar
        self.as_indexed = as_indexed
        self.folder = cachefiles.private_folder(self.folder)  # (the same folder when the caller made it private)
        self._open: dict[int, tuple[int, mmap.mmap, np.ndarray]] = {}
        # Two locks, so that decoding never waits behind a fetch ahead: `_lock` guards `_open` and is held only
        # briefly; `_fetching` makes one thread at a time fetch, verify or evict (byte-range locks keep other
        # processes apart, not the threads of one).
        self._lock, self._fetching = threading.Lock(), threading.Lock()
        self._warned = False

    def __getstate__(self):
        return {**self.__dict__, "_open": {}, "_lock": None, "_fetching": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock, self._fetching = threading.Lock(), threading.Lock()

    def path(self, i: int) -> Path:
        return self.folder / f"{self.sha[i]}.shard"

    def map(self, i: int) -> mmap.mmap:
        with self._lock:
            return self._file(i)[1]

    def _file(self, i: int) -> tuple[int, mmap.mmap, np.ndarray]:
        f = self._open.get(i)
        if f is None:
            path, size = self.path(i), self.sizes[i] + len(self.spans[i])
            fd = cachefiles.open_own(path, os.O_RDWR) if os.path.lexists(path) else None  # no link, no one else's
            if fd is not None and os.fstat(fd).st_size != size:
                # The same bytes cached under another index (`inspect --repair` leaves samples out of the .idx,
                # not the tar): its presence bytes count other samples, so this copy starts again.
                os.close(fd)
                fd = None
                for p in (path, cachefiles.stamp_path(path)):
                    p.unlink(missing_ok=True)
            if fd is None:
                cachefiles.create_sparse(path, size)
                fd = cachefiles.open_own(path, os.O_RDWR)
            m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            f = self._open[i] = (fd, m, np.frombuffer(m, np.uint8)[self.sizes[i]:])
            cachefiles.touch(path)
        return f

    def check(self, i: int) -> None:
        """Before use: a complete cached shard that was not checked as it is now is checked against its sha256."""
        path = self.path(i)
        if not path.exists():
            return
        with self._fetching:
            with self._lock:
                complete = self._file(i)[2].all()
            if complete and not cachefiles.stamped(path):
                self._verify(i, refetch=False)

    def ensure(self, wanted: dict[int, np.ndarray]) -> dict[int, mmap.mmap]:
        """Make the samples present: {shard: sample indices within it}; the maps they are present in. Read them
        through these maps: a cached file evicted later stays readable through its map, while the shard's next
        file (after eviction) may not hold them. Thread-safe; other processes share the files."""
        with self._lock:  # usually all here (fetched ahead): presence and maps taken together, no waiting
            if not self._missing(wanted):
                return {i: self._file(i)[1] for i in wanted}
        with self._fetching:
            with self._lock:
                todo = self._missing(wanted)
            if todo:
                self._fetch(todo, keep=set(wanted))
            with self._lock:  # before anything else may evict them
                return {i: self._file(i)[1] for i in wanted}

    def forget(self, i: int, js: np.ndarray) -> None:
        """Mark samples `js` of shard i absent, so that the next `ensure` fetches them again: a sample whose cached
        bytes do not decode may be damage in the cache (a presence byte set without its bytes), not in the data."""
        with self._fetching:
            with self._lock:
                fd = self._file(i)[0]
            for j in np.unique(js).tolist():
                os.pwrite(fd, b"\0", self.sizes[i] + j)
            cachefiles.stamp_path(self.path(i)).unlink(missing_ok=True)

    def _missing(self, wanted: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        todo = {}
        for i, js in wanted.items():
            have = self._file(i)[2]
            missing = np.unique(js[have[js] == 0])
            if len(missing):
                todo[i] = missing
        return todo

    def _fetch(self, todo: dict[int, np.ndarray], keep: set[int]) -> None:
        touched = set(todo)
        while todo:
            held, contested = self._claim(todo)
            try:
                self._download(held)
            finally:
                for i, start, end, _ in held:
                    cachefiles.unlock(self._open[i][0], start, end)
            todo = {}
            for i, start, end, js in contested:  # another process is fetching these: wait for it, then re-check
                fd, _, have = self._open[i]
                fcntl.lockf(fd, fcntl.LOCK_EX, end - start, start)
                cachefiles.unlock(fd, start, end)
                missing = js[have[js] == 0]  # the other fetch covered a different range, or failed
                if len(missing):
                    todo[i] = np.union1d(todo.get(i, missing), missing)
        self._completed(touched)
        self._evict(keep)

    def _claim(self, todo: dict[int, np.ndarray]) -> tuple[list, list]:
        """Coalesced ranges of the samples in `todo`: (those this process now holds the lock of and still needs,
        those another process holds). Leftovers of the second are fetched together in the next round, in flight
        at once, not one round trip after another."""
        held, contested = [], []
        for i, js in todo.items():
            fd, _, have = self._open[i]
            order = js[np.argsort(self.spans[i][js, 0])]
            for start, end, rows in coalesce(self.spans[i][order]):
                if not cachefiles.try_lock(fd, start, end):
                    contested.append((i, start, end, order[rows]))
                    continue
                still = order[rows][have[order[rows]] == 0]  # another process may have fetched them meanwhile
                if len(still):
                    held.append((i, start, end, still))
                else:
                    cachefiles.unlock(fd, start, end)
        return held, contested

    def _download(self, parts: list[tuple[int, int, int, np.ndarray]]) -> None:
        if not parts:
            return
        datas = self.remote.ranges([(self.rel[i], s, e) for i, s, e, _ in parts])
        for (i, start, end, _), data in zip(parts, datas):
            lo, hi = self._inside(i, start, end)
            if not self._as_indexed(i, lo, hi, start, data):  # an object is replaced whole: no point in asking again
                raise DataError(f"{self.remote.join(self.rel[i])} bytes {start}-{end - 1} are not what its index says "
                                f"(tar headers differ): the shard was replaced after dataset.json was written; re-run "
                                f"`fastpipe shard`, or restore it")
            fd = self._open[i][0]
            os.pwrite(fd, data, start)
            if hi > lo:  # the presence bytes are written after the bytes they vouch for
                os.pwrite(fd, b"\1" * int(hi - lo), self.sizes[i] + int(lo))
            cachefiles.touch(self.path(i))

    def _inside(self, i: int, start: int, end: int) -> tuple[int, int]:
        """The samples wholly inside bytes [start, end) of shard i: rows lo to hi (spans are in file order)."""
        spans = self.spans[i]
        return int(np.searchsorted(spans[:, 0], start)), int(np.searchsorted(spans[:, 1], end, side="right"))

    def _as_indexed(self, i: int, lo: int, hi: int, start: int, data: bytes) -> bool:
        """Whether the tar header before each image in the range is where the index says, of its size. The
        sha256 check needs a whole shard, which a rank reading its part of each may never have: this catches a
        shard replaced in the store after conversion at once, before a wrong label is read from it."""
        heads = self.heads[i][lo:hi]
        heads = heads[heads[:, 0] >= 0]  # a sample without an image (inspect reports it)
        if not len(heads):
            return True
        return self.as_indexed(data, start, heads)

    def _completed(self, shards: set[int]) -> None:
        for i in shards:
            if self._open[i][2].all() and not cachefiles.stamped(self.path(i)):
                self._verify(i, refetch=True)

    def _verify(self, i: int, refetch: bool) -> None:
        """Check a complete shard's sha256; a bad one is deleted, and fetched again once when `refetch`."""
        m = self._open[i][1]
        if hashlib.sha256(memoryview(m)[: self.sizes[i]]).hexdigest() == self.sha[i]:
            cachefiles.stamp(self.path(i))
            return
        self._drop(i)
        if not refetch:
            warnings.warn(f"cached copy of {self.remote.join(self.rel[i])} was damaged; it is fetched again",
                          FastpipeWarning, stacklevel=3)
            return
        all_samples = np.arange(len(self.spans[i]))
        with self._lock:
            self._file(i)
        self._download([(i, s, e, all_samples[rows]) for s, e, rows in coalesce(self.spans[i])])
        if hashlib.sha256(memoryview(self._open[i][1])[: self.sizes[i]]).hexdigest() != self.sha[i]:
            self._drop(i)
            raise DataError(f"{self.remote.join(self.rel[i])} does not match dataset.json (sha256 differs, fetched "
                            f"twice): the object was changed after conversion; re-run `fastpipe shard`, or restore it")
        cachefiles.stamp(self.path(i))

    def _drop(self, i: int) -> None:
        """Forget a cached file and delete it. Its map is not closed: a reader may hold it (see `ensure`); it
        closes when the last one lets go."""
        with self._lock:
            fd, _, _ = self._open.pop(i)
        for p in (self.path(i), cachefiles.stamp_path(self.path(i))):
            p.unlink(missing_ok=True)
        os.close(fd)

    def _evict(self, keep: set[int]) -> None:
        """Whole shards, least recently used first, until the cache is under its limit; not the shards of the
        request being served (`keep`). One this process has open is let go here (its readers keep their map of it,
        see `ensure`); one another process has open stays readable there until it lets go."""
        if not self.limit:
            return
        files = []
        for e in os.scandir(self.folder):
            if e.name.endswith(".shard"):
                st = e.stat(follow_symlinks=False)
                files.append((st.st_atime_ns, st.st_blocks * 512, Path(e.path)))
        used = sum(f[1] for f in files)
        kept = {self.path(i) for i in keep}
        with self._lock:
            mine = {self.path(i): i for i in self._open}
        for _, nbytes, path in sorted(files):
            if used <= self.limit:
                return
            if path in kept:
                continue
            if path in mine:
                self._drop(mine[path])
            for p in (path, cachefiles.stamp_path(path), path.with_suffix(".idx")):
                p.unlink(missing_ok=True)
            used -= nbytes
        if used > self.limit and not self._warned:
            self._warned = True
            warnings.warn(f"the shard cache {self.folder} needs {used / 1e6:,.1f} MB for the shards of one fetch, over "
                          f"its limit of {self.limit / 1e6:,.1f} MB: raise cache_limit", FastpipeWarning, stacklevel=4)


__all__ = ["ShardCache", "coalesce", "default_cache_dir", "tiling"]

"""Data sets in object storage: any fsspec URL (s3://, gs://, az://, http(s)://, ...) where a folder is accepted.

`Remote` is the only code that talks to a store. It reads whole small objects (dataset.json, `.idx` files) and
byte ranges of shards, several requests in flight, each retried with exponential backoff and jitter on what is
transient (5xx, throttling, resets, timeouts) and then failing with the URL and byte range: never a hang, never a
short read taken for data. Credentials and endpoints come from `storage_options` or the store's usual environment
(`AWS_*` including `AWS_ENDPOINT_URL`, `GOOGLE_APPLICATION_CREDENTIALS`, `AZURE_STORAGE_*`); `storage_options` is
held in memory only, never written or printed (`repr` shows the URL).

The store's own clients retry too (botocore, s3fs, gcsfs, the Azure SDK): clients.py switches those retries off
where it makes a client, so that one policy applies, it is bounded in time, and `loader.stats` can count it.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from fastpipe.errors import ConfigError, DataError
from fastpipe.store import hub
from fastpipe.store.clients import ObjectTooLarge, brief, cat_bounded, open_fs, refused, store_environment, transient
from fastpipe.store.counters import Counters
from fastpipe.store.urls import URL_RE, check_relative, check_url, redact

SMALL_OBJECT = 64 << 20  # bytes: the most a whole-object read (dataset.json, a .idx, rejected.jsonl) may return
CREDENTIALS = {"": "storage_options or the AWS_/GOOGLE_/AZURE_ environment",
               "hf": "HF_TOKEN or hf auth login; a gated repository's terms accepted on the Hub"}


# The filesystem clients made in this process, by id: fsspec clients of one URL compare equal, so a WeakSet
# would hold one of them.
_MADE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_INHERITED: list = []  # a forked child's copies of its parent's clients: kept, never used, never closed


def _after_fork_in_child() -> None:
    """The parent's clients are the parent's. Freed in a child, fsspec's finalizer closes a client's session on
    the parent's event loop, which does not run here: it waited for a timeout (seconds at each worker's start,
    with fsspec's HTTP client), then closed the connections itself, and so took their sockets out of the epoll set
    that parent and child share: the parent's next requests on them waited for the full read timeout. So a child
    keeps them alive and their finalizers detached."""
    inherited = list(_MADE.values())
    if not inherited:  # a process that never read a store (local data): nothing to look through
        return
    _INHERITED.extend(inherited)
    ids = {id(c) for c in inherited}
    for f in list(getattr(weakref.finalize, "_registry", {})):
        info = f.peek()
        if info is not None and id(info[0]) in ids:
            f.detach()


os.register_at_fork(after_in_child=_after_fork_in_child)


def is_url(text) -> bool:
    return isinstance(text, str) and bool(URL_RE.match(text))


class RemoteError(DataError):
    """An object that is missing, refused, or still failing after the retries."""


class Remote:
    """A data set's folder in a store: `url` plus the options to reach it; one filesystem client per process."""

    folder = None  # no folder on this machine: what is read is fetched (location.Folder has one)

    def __init__(self, url: str, storage_options: dict | None = None, *, timeout: float | None = None,
                 attempts: int | None = None, base_delay: float = 0.25, inflight: int = 16, cache=None):
        if not is_url(url):
            raise ConfigError(f"{redact(url)!r} is not a URL (expected e.g. s3://bucket/prefix)")
        self.url, self.options = check_url(url, "data set").rstrip("/"), dict(storage_options or {})
        # A request that sends nothing for `timeout` s is retried; `attempts` in all, then an error
        # ($FASTPIPE_REMOTE_TIMEOUT, $FASTPIPE_REMOTE_ATTEMPTS)
        self.timeout = timeout or float(os.environ.get("FASTPIPE_REMOTE_TIMEOUT", 60))
        self.attempts = attempts or int(os.environ.get("FASTPIPE_REMOTE_ATTEMPTS", 6))
        # ... and every request has a total deadline: `timeout` plus its size at this floor rate (bytes/s), so that
        # a server that trickles a byte at a time (each resetting the read timeout) still fails in bounded time
        self.min_rate = float(os.environ.get("FASTPIPE_REMOTE_MIN_RATE", 1 << 20))
        self.base_delay, self.inflight = base_delay, inflight
        self.cache = cache  # location.NodeCache: where this node keeps the shards it reads (cache.py); None: none
        self.counters = Counters()
        self._local = None  # (pid, fs, root path, pool): rebuilt in each process (workers fork or spawn)
        # Workers forked from a server process (fastpipe's once DALI is loaded: loaders/stream.py) have that
        # server's environment, from whenever it started: they take the store's variables as they are now.
        self.env, self.pid = store_environment(), os.getpid()

    def __repr__(self) -> str:  # never the options or the environment: they may hold keys
        return f"Remote({self.url!r})"

    def __getstate__(self):
        return {**self.__dict__, "_local": None}

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0].lower()

    def _client(self):
        """This process's client: a forked child makes its own (the parent's is bound to the parent's event loop
        and connections; see _after_fork_in_child)."""
        if self._local is None or self._local[0] != os.getpid():
            if os.getpid() != self.pid:
                os.environ.update(self.env)
            fs, root = open_fs(self.url, self.options, self.timeout)
            _MADE[id(fs)] = fs
            self._local = (os.getpid(), fs, root, ThreadPoolExecutor(self.inflight, thread_name_prefix="fastpipe-io"))
        return self._local[1:]

    def join(self, rel: str) -> str:
        """The URL of a file of this data set (`rel` as urls.check_relative allows: it cannot leave the folder)."""
        return f"{self.url}/{check_relative(rel, 'a path in ' + self.url)}"

    @property
    def identity(self) -> str:
        """What names this location in records and cache keys (location.Folder's: its absolute path)."""
        return self.url

    def relative(self, where: str) -> str:
        """The name inside this folder of one of its objects' URLs (join's inverse)."""
        return where[len(self.url) + 1:] if where.startswith(self.url + "/") else where

    def cat(self, rel: str, limit: int = SMALL_OBJECT) -> bytes:
        """A whole object of at most `limit` bytes (a larger one is not read past it: ObjectTooLarge, the cause)."""
        return self.cat_many([rel], limit)[0]

    def cat_many(self, rels: list[str], limit: int = SMALL_OBJECT) -> list[bytes]:
        """Several whole objects of at most `limit` bytes each, concurrently: more at once than ranges (`.idx`
        files at start-up; a round trip each is what they cost)."""
        out = self._read([(rel, None, None) for rel in rels], max(64, self.inflight), limit)
        self.counters.add(len(rels), sum(map(len, out)))
        return out

    def ranges(self, parts: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes [start, end) of object `rel` for each (rel, start, end), fetched concurrently; each exactly as
        long as asked."""
        out = [self._checked(p, data) for p, data in zip(parts, self._read(parts))]
        self.counters.add(len(parts), sum(e - s for _, s, e in parts))
        return out

    def _read(self, parts: list[tuple[str, int | None, int | None]], inflight: int | None = None,
              limit: int = SMALL_OBJECT) -> list[bytes]:
        """(rel, start, end) each, None for a whole object; each retried. An async client (s3fs, gcsfs, adlfs,
        http) gets them all in one call on its event loop, `inflight` at a time: a thread per request handing each
        to that loop cost 1.5x the CPU (0.36 s against 0.25 s per 100 MB over loopback: benchmarks/bench_io.py,
        docs/results/io.json), and that comes out of decoding on a busy machine."""
        fs, root, pool = self._client()
        for rel, _, _ in parts:
            self.join(rel)  # the path policy (urls.check_relative), before any request
        if not getattr(fs, "async_impl", False):  # a whole object asked as its first limit + 1 bytes
            return list(pool.map(lambda p: self._sized(self._retry(lambda: fs.cat_file(
                f"{root}/{p[0]}", start=p[1], end=limit + 1 if p[1] is None else p[2]), self.join(p[0]), p[1:]),
                p, limit), parts))
        out: list = [None] * len(parts)
        todo = list(range(len(parts)))
        for attempt in range(1, self.attempts + 1):
            got = self._bounded(fs, [(f"{root}/{parts[k][0]}", parts[k][1], parts[k][2]) for k in todo],
                                inflight or self.inflight, limit)
            failed = []
            for k, data in zip(todo, got):
                if isinstance(data, BaseException):
                    self._give_up(data, self.join(parts[k][0]), parts[k][1:], attempt)
                    failed.append(k)
                else:
                    out[k] = data
            if not failed:
                return out
            self.counters.add(retries=len(failed))
            self._backoff(attempt)
            todo = failed
        raise AssertionError("unreachable")

    def _bounded(self, fs, requests: list[tuple[str, int | None, int | None]], inflight: int, limit: int) -> list:
        """The requests on the client's event loop, `inflight` at a time, each within its deadline and size limit;
        an exception in place of each that failed."""
        import fsspec.asyn

        async def all_of_them():
            gate = asyncio.Semaphore(inflight)

            async def one(path, start, end):
                size = limit if start is None else end - start
                deadline = self.timeout + size / self.min_rate
                async with gate:
                    try:
                        return await asyncio.wait_for(cat_bounded(fs, path, start, end, size), deadline)
                    except asyncio.TimeoutError:
                        return TimeoutError(f"no complete answer within {deadline:.0f} s ({size} bytes at the floor "
                                            f"rate of {self.min_rate / 2**20:g} MiB/s, $FASTPIPE_REMOTE_MIN_RATE)")
                    except Exception as e:
                        return e

            return await asyncio.gather(*(one(*r) for r in requests))

        return fsspec.asyn.sync(fs.loop, all_of_them)

    def _sized(self, data: bytes, part: tuple[str, int | None, int | None], limit: int) -> bytes:
        """A client without an event loop (no deadline to set) is held to the size limit after the read."""
        if part[1] is None and len(data) > limit:
            raise RemoteError(f"{self.join(part[0])}: {len(data)} bytes, over the limit of {limit}") from \
                ObjectTooLarge(f"{len(data)} bytes or more, over the limit of {limit}")
        return data

    def _checked(self, part: tuple[str, int, int], data: bytes) -> bytes:
        rel, start, end = part
        if len(data) != end - start:
            raise RemoteError(f"{self.join(rel)}: asked for bytes {start}-{end - 1}, got {len(data)} bytes: the "
                              f"object is shorter than dataset.json says, or the server ignores Range requests")
        return data

    def listing(self, checksums: bool = False) -> list[tuple]:
        """(path relative to this folder, size[, its sha256 where the store lists one: the Hub's LFS files, or
        None]) of every object below it, in one listing (a store that can list: not plain HTTP)."""
        fs, root, _ = self._client()
        found = self._retry(lambda: fs.find(root, detail=True), self.url)
        base = root.rstrip("/") + "/"
        return sorted((p[len(base):], int(info.get("size") or 0), *(((info.get("lfs") or {}).get("sha256"),)
                                                                     if checksums else ()))
                      for p, info in found.items() if p.startswith(base) and info.get("type", "file") == "file")

    def without_credentials(self) -> Remote:
        """This folder as another machine (a Ray node) reads it: with its own credentials (an instance role, the
        AWS_/GOOGLE_/AZURE_ variables of its environment). Neither storage_options nor this machine's store
        variables travel with the copy."""
        other = copy.copy(self)
        other.options, other.env, other.counters = {}, {}, Counters()
        return other

    def glob(self, pattern: str) -> list[str]:
        """Names of the objects in this folder that match `pattern` (a store that can list: not plain HTTP)."""
        fs, root, _ = self._client()
        found = self._retry(lambda: self._call(fs, "glob", f"{root}/{pattern}"), self.join(pattern))
        return sorted(p.rsplit("/", 1)[-1] for p in found)

    def delete(self, rel: str) -> None:
        """Remove an object; one already gone is fine."""
        fs, root, _ = self._client()
        try:
            self._retry(lambda: self._call(fs, "rm_file", f"{root}/{rel}"), self.join(rel))
        except RemoteError as e:
            if not isinstance(e.__cause__, FileNotFoundError):
                raise

    def check_writable(self) -> None:
        """Write and remove a small object, before work that ends in uploads: a missing bucket, missing or refused
        credentials fail here, at once, not after a whole conversion."""
        if self.protocol == "hf":  # its permission check: a probe object would be two commits
            return hub.check_writable(self.url, self.options, self._retry)
        fs, root, _ = self._client()
        probe = ".fastpipe-write-check"
        try:
            self._retry(lambda: self._call(fs, "pipe_file", f"{root}/{probe}", b"fastpipe"), self.join(probe))
            self.delete(probe)
        except RemoteError as e:
            raise RemoteError(f"cannot write to {self.url} (nothing was converted yet): {e}") from e.__cause__

    def exists(self, rel: str) -> bool:
        fs, root, _ = self._client()
        return bool(self._retry(lambda: self._call(fs, "exists", f"{root}/{rel}"), self.join(rel)))

    def get_many(self, files: list[tuple[str, os.PathLike]]) -> None:
        """Download whole objects to local files (relative name, local path), several at a time, each retried."""
        fs, root, pool = self._client()

        def one(item):
            rel, local = item
            path = f"{root}/{rel}"
            size = self._retry(lambda: self._call(fs, "size", path), self.join(rel)) or 0
            self._retry(lambda: self._call(fs, "get_file", path, str(local), size=size), self.join(rel))
            self.counters.add(1, os.path.getsize(local))

        list(pool.map(one, files))

    def put_many(self, files: list[tuple[os.PathLike, str]]) -> None:
        """Upload local files to objects (local path, relative name), several at a time, each retried."""
        fs, root, pool = self._client()

        def one(item):
            local, rel = item
            size = os.path.getsize(local)
            self._retry(lambda: self._call(fs, "put_file", str(local), f"{root}/{rel}", size=size), self.join(rel))
            self.counters.add(1, size)

        list(pool.map(one, files))

    def _call(self, fs, method: str, *args, size: int = 0):
        """fs.method(*args) within its deadline, `timeout` plus `size` bytes at the floor rate: an async client's
        call is cancelled when it passes it (fsspec's sync(timeout=)); a client without an event loop has its
        connect and read timeouts only."""
        coroutine = getattr(fs, f"_{method}", None) if getattr(fs, "async_impl", False) else None
        if coroutine is None:
            return getattr(fs, method)(*args)
        import fsspec.asyn

        return fsspec.asyn.sync(fs.loop, coroutine, *args, timeout=self.timeout + size / self.min_rate)

    def _retry(self, call, url: str, span: tuple[int, int] | None = None):
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except Exception as e:
                self._give_up(e, url, span, attempt)
                self.counters.add(retries=1)
                self._backoff(attempt)
        raise AssertionError("unreachable")

    def _give_up(self, e: BaseException, url: str, span: tuple[int, int] | None, attempt: int) -> None:
        """Raise the error a user reads for `e`, unless it is transient and attempts are left."""
        where = f"{url}" + (f" bytes {span[0]}-{span[1] - 1}" if span and span[0] is not None else "")
        if isinstance(e, NotImplementedError):
            raise RemoteError(f"{url}: this store does not take writes through fsspec ({self.protocol}://)") from e
        if isinstance(e, FileNotFoundError):
            raise RemoteError(f"{url} not found: check the URL, that the upload finished, or the credentials") from e
        if refused(e):
            raise RemoteError(f"{url}: access refused ({brief(e)}); check the credentials "
                              f"({CREDENTIALS.get(self.protocol, CREDENTIALS[''])})") from e
        if not transient(e) or attempt == self.attempts:
            kind = f"still failing after {attempt} attempts" if transient(e) else "failed"
            raise RemoteError(f"reading {where} {kind}: {type(e).__name__}: {brief(e)}") from e

    def _backoff(self, attempt: int) -> None:
        # full jitter: many workers retrying a throttled store must not retry in step
        time.sleep(random.uniform(0, min(10.0, self.base_delay * 2 ** (attempt - 1))))


__all__ = ["Counters", "Remote", "RemoteError", "is_url", "transient"]

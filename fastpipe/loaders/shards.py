"""Reading samples out of a split's shards through the `.idx` files: any sample by its id, in one memory copy.

The index of every shard is parsed and checked once, at construction, into flat arrays (offset and size of each
sample's image and label), so a missing or truncated shard, a damaged index or one whose count disagrees with
dataset.json fails there, naming the file, not later in a worker. Reading a sample is then a slice of the shard's
memory map (the page cache does the I/O): no tar parsing and no per-sample system call. The shards stay plain
WebDataset shards that `webdataset.WebDataset` reads (tests, the baseline in benchmarks/bench_loaders.py).
"""

from __future__ import annotations

import json
import mmap
import threading
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np

from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest
from fastpipe.dataset.shardformat import BLOCK, decode_label, label_array, parse_index, range_as_indexed, read_index
from fastpipe.errors import DataError
from fastpipe.loaders.batch import RawBatch
from fastpipe.loaders.epoch import Piece
from fastpipe.store.location import Folder


class ShardError(DataError):
    """A shard or index that is missing, truncated, or disagrees with dataset.json."""


@dataclass(frozen=True)
class RawSample:
    id: int  # global sample id: position in the split's shards concatenated in manifest order
    key: str
    shard: str
    image: bytes
    label: int | tuple[int, ...]  # a class index, or a multi-label sample's class indices


def _cached_entries(text: bytes, shard):
    """A node-cache copy of a shard's index, parsed; None when it is damaged (a crash while it was written)."""
    try:
        entries = parse_index(text, shard.index, shard.bytes)
    except DataError:
        return None
    return entries if len(entries) == shard.samples else None


class ShardSet:
    """The shards of one split, their indexes checked against the manifest, read by sample id."""

    def __init__(self, manifest: Manifest, split: str):
        info = manifest.split(split)
        self.root = manifest.root
        # what reads the files: a store's through this node's cache (cache.py), a folder's in place
        self.files = manifest.files if manifest.files is not None else Folder(manifest.root)
        self.names = [PurePosixPath(s.path).name for s in info.shards]
        self.paths = [manifest.root / s.path for s in info.shards]
        self.index_paths = [manifest.root / s.index for s in info.shards]
        self.counts = [s.samples for s in info.shards]
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.image_ext = manifest.components.image
        self.label_ext = manifest.components.label_bin or manifest.components.label
        self.meta_ext = manifest.components.meta
        self.num_classes = manifest.num_classes
        self.multilabel = manifest.multilabel
        n = self.total
        self.offsets = np.zeros((n, 3), np.int64)  # image, label, meta (-1: none)
        self.sizes = np.zeros((n, 3), np.int64)
        self.keys: list[str] = []
        self.cache = None
        # each single-label sample's label once read (-1: not yet), per process: later epochs gather them in one step
        self.known = None if self.multilabel else np.full(n, -1, np.int64)  # the batch's dtype: no conversion
        self.fetch_wait_s = 0.0  # waited for a fetch ahead (prefetch.fetched_ahead) since the last read
        if self.files.cache is not None:
            self._check_remote(manifest, info)
        else:
            for i, shard in enumerate(info.shards):
                self._check(manifest, i, shard)
        self._maps: dict[int, mmap.mmap] = {}
        self._views: list[memoryview | None] = [None] * len(self.paths)  # by shard: what a batch's spans index
        self._unmapped = np.array([len(self.paths)])  # shards without a view (in place: copies share it)
        self._mapping = threading.Lock()
        self._arrays: dict[int, np.ndarray] = {}
        # per sample, what a batch's read gathers in one step: its shard, and its image's start and end
        ends = self.offsets[:, 0] + self.sizes[:, 0]
        self.spans = np.stack([np.repeat(np.arange(len(self.paths)), self.counts), self.offsets[:, 0], ends], 1)
        self._need = [int(ends[a:b].max(initial=0)) for a, b in zip(self.starts[:-1], self.starts[1:])]

    def _check(self, manifest: Manifest, i: int, shard) -> None:
        path, idx = self.paths[i], self.index_paths[i]
        where = manifest.root / MANIFEST_NAME
        if not path.is_file():
            raise ShardError(f"shard {path} is missing (listed in {where})")
        if path.stat().st_size != shard.bytes:
            raise ShardError(f"shard {path} is {path.stat().st_size} bytes but dataset.json says {shard.bytes}: "
                             f"a truncated or altered copy; copy it again or re-run `fastpipe shard`")
        if not idx.is_file():
            raise ShardError(f"index {idx} is missing: rebuild it with `fastpipe index --idx-only {path}` "
                             f"(writes the .idx only, dataset.json stays as it is)")
        self._add_entries(manifest, i, shard, read_index(idx, shard.bytes))

    def _check_remote(self, manifest: Manifest, info) -> None:
        """The indexes, from the node's cache or fetched (concurrently), checked as for local shards; the shards'
        bytes are fetched when read. A cached shard is checked against its sha256 before use."""
        from fastpipe.store.cache import ShardCache, tiling
        from fastpipe.store.cachefiles import cached_indexes, keep_index

        r = self.files
        texts, cached = cached_indexes(r, r.cache.folder, [s.index for s in info.shards],
                                       [s.sha256 for s in info.shards])
        for i, (shard, text, was_cached) in enumerate(zip(info.shards, texts, cached)):
            entries = _cached_entries(text, shard) if was_cached else None
            fresh = entries is None
            if fresh:
                if was_cached:  # a damaged copy (a crash while it was written): fetched again
                    text = r.cat(shard.index)
                entries = parse_index(text, r.join(shard.index), shard.bytes)
            self._add_entries(manifest, i, shard, entries)
            if fresh:
                keep_index(r.cache.folder, shard.sha256, text)
        spans, heads = [], []
        for i, shard in enumerate(info.shards):
            rows = slice(self.starts[i], self.starts[i + 1])
            spans.append(tiling(np.where(self.offsets[rows] >= 0, self.offsets[rows] + self.sizes[rows], 0).max(1),
                                shard.bytes))
            heads.append(np.stack([self.offsets[rows, 0] - BLOCK, self.sizes[rows, 0]], 1))
        self.cache = ShardCache(r, r.cache.folder, r.cache.limit, [s.path for s in info.shards],
                                [s.bytes for s in info.shards], [s.sha256 for s in info.shards], spans, heads,
                                range_as_indexed)
        for i in range(len(info.shards)):
            self.cache.check(i)

    def _add_entries(self, manifest: Manifest, i: int, shard, entries) -> None:
        path, idx = self.files.join(shard.path), self.files.join(shard.index)
        where = manifest.location + "/" + MANIFEST_NAME
        if len(entries) != shard.samples:
            raise ShardError(f"index {idx} lists {len(entries)} samples but {where} says {shard.samples}: rebuild "
                             f"the index with `fastpipe index --idx-only {path}`, or re-run the conversion")
        base = int(self.starts[i])
        for j, (key, parts) in enumerate(entries):
            missing = [e for e in (self.image_ext, self.label_ext) if e not in parts]
            if missing:
                raise ShardError(f"shard {path}, sample {key!r}: no .{' or .'.join(missing)} member "
                                 f"(has {', '.join(sorted(parts))})")
            meta = parts.get(self.meta_ext, (-1, 0)) if self.meta_ext else (-1, 0)
            self.offsets[base + j] = (parts[self.image_ext][0], parts[self.label_ext][0], meta[0])
            self.sizes[base + j] = (parts[self.image_ext][1], parts[self.label_ext][1], meta[1])
            self.keys.append(key)

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def shard_of(self, ids) -> np.ndarray:
        return np.searchsorted(self.starts, ids, side="right") - 1

    def _map(self, shard: int) -> mmap.mmap:
        m = self._maps.get(shard)
        if m is None and self.cache is not None:
            m = self._maps[shard] = self.cache.map(shard)
        if m is None:  # opened lazily in each process (a worker maps only the shards it reads)
            with open(self.paths[shard], "rb") as f:
                m = self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def _view(self, shard: int, offset: int, size: int) -> memoryview:
        mv = self._views[shard]
        if mv is None:
            mv = self._mapped(shard)
        data = mv[offset : offset + size]
        if len(data) != size:
            self._truncated(shard, offset + size)
        return data

    def _mapped(self, shard: int) -> memoryview:
        """The shard's view, mapped once: a folder's copies (other threads) share the views and their count."""
        with self._mapping:
            mv = self._views[shard]
            if mv is None:
                mv = memoryview(self._map(shard))
                if len(mv) < self._need[shard]:  # checked once, where it is mapped: a batch's slices are then whole
                    self._truncated(shard, self._need[shard])
                self._views[shard] = mv
                self._unmapped -= 1
            return mv

    def _truncated(self, shard: int, end: int):
        raise ShardError(f"shard {self.where(shard)} ends before byte {end}: the file was truncated after the loader "
                         f"opened it; copy it again")

    def _array(self, shard: int) -> np.ndarray:
        a = self._arrays.get(shard)
        if a is None:
            a = self._arrays[shard] = np.frombuffer(self._map(shard), np.uint8)
        return a

    def _bytes(self, shard: int, offset: int, size: int) -> bytes:
        return bytes(self._view(shard, offset, size))

    def fetch(self, ids, shards: np.ndarray | None = None, remap: bool = True) -> None:
        """Remote data: make these samples present in the node's cache (a no-op for local data, and for samples
        already cached), and read them through the maps they are present in (`remap`). SampleStream also calls
        it ahead of time from a thread (remap=False: that thread's maps are for later batches)."""
        if self.cache is None:
            return
        ids = np.asarray(ids, dtype=np.int64)
        shards = self.shard_of(ids) if shards is None else shards
        maps = self.cache.ensure({s: ids[shards == s] - self.starts[s] for s in np.unique(shards).tolist()})
        for s, m in maps.items() if remap else ():
            if self._maps.get(s) is not m:  # the cached file was evicted and fetched again since
                with self._mapping:
                    self._maps[s] = m
                    if self._views[s] is not None:  # a new list: a batch read before keeps the maps it was read in
                        self._views = [None if j == s else v for j, v in enumerate(self._views)]
                        self._unmapped += 1
                    self._arrays.pop(s, None)

    def refetch(self, i: int) -> tuple[memoryview, np.ndarray] | None:
        """Remote data: sample i fetched again from the store, (its image, its label row); None for local data,
        where there is nothing to fetch. A cached copy that does not decode is fetched once more before the sample
        is called bad: the damage may be the cache's, and then its label bytes are suspect too."""
        if self.cache is None:
            return None
        s = int(self.shard_of(i))
        self.cache.forget(s, np.array([i - int(self.starts[s])]))
        ids, shards = np.array([i]), np.array([s])
        if self.known is not None:
            self.known[i] = -1  # read from the damaged copy, maybe: read again
        self.fetch(ids, shards)
        label = self.labels(ids, shards)[0]
        return self._view(s, int(self.offsets[i, 0]), int(self.sizes[i, 0])), label

    def where(self, shard: int) -> str:
        """The shard's path, or its URL for a data set in object storage (for messages)."""
        return self.files.join(self.rel_path(shard))

    def rel_path(self, shard: int) -> str:
        return self.paths[shard].relative_to(self.root).as_posix()

    def sample(self, i: int, shard: int | None = None) -> RawSample:
        shard = int(self.shard_of(i)) if shard is None else shard
        self.fetch([i], np.array([shard]))
        (io_, lo_, _), (in_, ln_, _) = self.offsets[i], self.sizes[i]
        return RawSample(i, self.keys[i], self.names[shard], self._bytes(shard, int(io_), int(in_)),
                         self.label(i, shard, self._bytes(shard, int(lo_), int(ln_))))

    def read(self, ids) -> RawBatch:
        """The samples `ids` (global ids): where each one's image is in the shards' memory maps, and their labels
        decoded batch-wise. In few Python steps: a worker thread runs them holding the GIL the training step needs."""
        start, self.fetch_wait_s = time.perf_counter() - self.fetch_wait_s, 0.0
        ids = np.asarray(ids, dtype=np.int64)
        spans = self.spans[ids]
        if self.cache is not None:
            self.fetch(ids)
        for s in np.unique(spans[:, 0]).tolist() if self._unmapped[0] else ():
            self._view(s, 0, 0)  # mapped (once), its bounds checked
        return RawBatch(self, ids, self._views, spans, self.labels(ids), time.perf_counter() - start)

    def labels(self, ids: np.ndarray, shards: np.ndarray | None = None) -> np.ndarray:
        """The batch's labels (label_array's). Binary `.lbl` records (what the converter writes) are gathered from
        the memory maps in one step per shard; text labels (foreign shards) or a record of the wrong size are decoded
        one by one, so that a bad one is named."""
        seen = self.known[ids] if self.known is not None else None
        if seen is not None and (not len(seen) or seen.min() >= 0):  # read before
            return seen
        shards = self.shard_of(ids) if shards is None else shards
        labels = self._labels(ids, shards, self.offsets[ids, 1], self.sizes[ids, 1])
        if self.known is not None:
            self.known[ids] = labels
        return labels

    def _labels(self, ids: np.ndarray, shards: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        width = self.num_classes if self.multilabel else 4
        if self.label_ext != "lbl" or not (sizes == width).all():
            labels = [self.label(int(i), int(s), self._bytes(int(s), int(o), int(n)))
                      for i, s, o, n in zip(ids, shards, offsets, sizes)]
            return label_array(labels, self.num_classes, self.multilabel)
        raw = np.empty((len(ids), width), np.uint8)
        for s in np.unique(shards).tolist():
            rows = shards == s
            where = offsets[rows][:, None] + np.arange(width)
            data = self._array(s)
            if where.size and where.max() >= len(data):
                self._truncated(s, int(where.max()) + 1)
            raw[rows] = data[where]
        if self.multilabel:
            return (raw != 0).astype(np.float32)
        labels = raw.view("<i4")[:, 0].astype(np.int64)
        bad = np.flatnonzero((labels < 0) | (labels >= self.num_classes))
        if len(bad):  # named by the one-by-one path
            i = int(ids[bad[0]])
            self.label(i, int(shards[bad[0]]), self._bytes(int(shards[bad[0]]), int(offsets[bad[0]]), width))
        return labels

    def read_piece(self, piece: Piece) -> list[RawSample]:
        first = int(self.starts[piece.shard]) + piece.start
        return [self.sample(i, piece.shard) for i in range(first, first + piece.count)]

    def label(self, i: int, shard: int, data: bytes) -> int | tuple[int, ...]:
        try:
            label = decode_label(data, self.label_ext, self.multilabel)
        except ValueError as e:
            raise ShardError(f"shard {self.where(shard)}, sample {self.keys[i]!r}: {e}") from None
        bad = [k for k in (label if self.multilabel else (label,)) if not 0 <= k < self.num_classes]
        if bad:
            raise ShardError(f"shard {self.where(shard)}, sample {self.keys[i]!r}: label {bad[0]} is outside the "
                             f"{self.num_classes} classes of dataset.json; `fastpipe inspect --verify` lists every "
                             f"such sample")
        return label

    def source(self, i: int) -> str | None:
        """The file a sample was converted from (its KEY.json), for tracing bad data; None for foreign shards."""
        if self.offsets[i, 2] < 0:
            return None
        s = int(self.shard_of(i))
        self.fetch([i], np.array([s]))
        try:
            return json.loads(self._bytes(s, int(self.offsets[i, 2]), int(self.sizes[i, 2]))).get("path")
        except (ValueError, AttributeError):
            return None

    def __copy__(self):
        """Another thread's ShardSet: a folder's maps are shared (they never change, and each epoch's threads would
        map every shard again); a store's start empty, as a fetch may replace a shard's map (threads._own_shards)."""
        mine = object.__new__(ShardSet)
        if self.cache is None:
            mine.__dict__.update(self.__dict__)
        else:
            mine.__setstate__(self.__getstate__())
        return mine

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"], state["_views"], state["_arrays"] = {}, [None] * len(self.paths), {}
        state["_unmapped"] = np.array([len(self.paths)])  # memory maps are per process
        del state["_mapping"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._mapping = threading.Lock()

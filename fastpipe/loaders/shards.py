"""Reading samples out of a split's shards, by sample ranges, through the `.idx` files.

Why not webdataset's streaming tar iterator: the epoch plan gives each worker exact sample ranges (see
epoch.py); with the index, a range is one seek and one sequential read, parsed by offsets, so a worker
never reads another worker's bytes and never parses tar headers. The shards are plain WebDataset shards, and
webdataset itself reads them (tests, the baseline in benchmarks/bench_loaders.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fastpipe.convert.writer import BLOCK, read_index
from fastpipe.loaders.epoch import Piece
from fastpipe.manifest import Manifest


class ShardError(RuntimeError):
    """A shard that is missing, truncated, or disagrees with dataset.json."""


@dataclass(frozen=True)
class RawSample:
    key: str
    shard: str
    image: bytes
    label: int


class ShardSet:
    """The shards of one split, checked against the manifest when opened (a missing file fails here, not as a
    hang in a worker)."""

    def __init__(self, manifest: Manifest, split: str):
        info = manifest.split(split)
        self.paths = [manifest.root / s.path for s in info.shards]
        self.index_paths = [manifest.root / s.index for s in info.shards]
        self.counts = [s.samples for s in info.shards]
        self.image_ext = manifest.components.image
        self.label_ext = manifest.components.label_bin or manifest.components.label
        self._index: dict[int, list] = {}
        for path, idx, shard in zip(self.paths, self.index_paths, info.shards):
            if not path.is_file():
                raise ShardError(f"shard {path} is missing (listed in {manifest.root / 'dataset.json'})")
            if path.stat().st_size != shard.bytes:
                raise ShardError(f"shard {path} is {path.stat().st_size} bytes but dataset.json says {shard.bytes}: "
                                 f"a truncated or altered copy; copy it again or re-run `fastpipe shard`")
            if not idx.is_file():
                raise ShardError(f"index {idx} is missing: run `fastpipe index {path}` to rebuild it")

    @property
    def total(self) -> int:
        return sum(self.counts)

    def index(self, shard: int) -> list:
        if shard not in self._index:
            self._index[shard] = read_index(self.index_paths[shard], with_keys=True)
        return self._index[shard]

    def _label(self, data: bytes) -> int:
        if self.label_ext == "lbl":
            return int(np.frombuffer(data, "<i4")[0])
        return int(data)

    def read(self, piece: Piece) -> Iterator[RawSample]:
        """The samples of one piece, from one sequential read."""
        entries = self.index(piece.shard)[piece.start : piece.start + piece.count]
        if not entries:
            return
        path = self.paths[piece.shard]
        lo = min(o for o, _ in entries[0][1].values()) - BLOCK
        hi = max(o + n for o, n in entries[-1][1].values())
        with open(path, "rb") as fh:
            fh.seek(lo)
            buf = fh.read(hi - lo)
        if len(buf) != hi - lo:
            raise ShardError(f"shard {path} ends at byte {lo + len(buf)}, before sample {entries[-1][0]} "
                             f"(byte {hi}): the file is truncated; copy it again")
        for key, parts in entries:
            (io_, in_), (lo_, ln_) = parts[self.image_ext], parts[self.label_ext]
            yield RawSample(key, path.name, buf[io_ - lo : io_ - lo + in_], self._label(buf[lo_ - lo : lo_ - lo + ln_]))

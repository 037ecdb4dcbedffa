"""Reading samples out of a split's shards, by sample ranges, through the `.idx` files.

Why not webdataset's streaming tar iterator: the epoch plan gives each worker exact sample ranges (see
epoch.py); with the index, a range is one seek and one sequential read, parsed by offsets, so a worker
never reads another worker's bytes and never parses tar headers. The shards are plain WebDataset shards, and
webdataset itself reads them (tests, the baseline in benchmarks/bench_loaders.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fastpipe.errors import DataError
from fastpipe.loaders.epoch import Piece
from fastpipe.manifest import MANIFEST_NAME, Manifest
from fastpipe.shardformat import BLOCK, decode_label, read_index


class ShardError(DataError):
    """A shard or index that is missing, truncated, or disagrees with dataset.json."""


@dataclass(frozen=True)
class RawSample:
    key: str
    shard: str
    image: bytes
    label: int


class ShardSet:
    """The shards of one split, checked against the manifest when opened: a missing or truncated shard, a damaged
    index or one whose sample count disagrees fails here, naming the file, not later in a worker."""

    def __init__(self, manifest: Manifest, split: str):
        info = manifest.split(split)
        self.paths = [manifest.root / s.path for s in info.shards]
        self.index_paths = [manifest.root / s.index for s in info.shards]
        self.counts = [s.samples for s in info.shards]
        self.image_ext = manifest.components.image
        self.label_ext = manifest.components.label_bin or manifest.components.label
        self.num_classes = manifest.num_classes
        self._index = [self._check(manifest, i, shard) for i, shard in enumerate(info.shards)]

    def _check(self, manifest: Manifest, i: int, shard) -> list:
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
        entries = read_index(idx, shard.bytes)
        if len(entries) != shard.samples:
            raise ShardError(f"index {idx} lists {len(entries)} samples but {where} says {shard.samples}: rebuild "
                             f"the index with `fastpipe index --idx-only {path}`, or re-run the conversion")
        for key, parts in entries:
            missing = [e for e in (self.image_ext, self.label_ext) if e not in parts]
            if missing:
                raise ShardError(f"shard {path}, sample {key!r}: no .{' or .'.join(missing)} member "
                                 f"(has {', '.join(sorted(parts))})")
        return entries

    @property
    def total(self) -> int:
        return sum(self.counts)

    def index(self, shard: int) -> list:
        return self._index[shard]

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
            yield RawSample(key, path.name, buf[io_ - lo : io_ - lo + in_],
                            self._label(buf[lo_ - lo : lo_ - lo + ln_], path, key))

    def _label(self, data: bytes, path, key: str) -> int:
        try:
            label = decode_label(data, self.label_ext)
        except ValueError as e:
            raise ShardError(f"shard {path}, sample {key!r}: {e}") from None
        if not 0 <= label < self.num_classes:
            raise ShardError(f"shard {path}, sample {key!r}: label {label} is outside the {self.num_classes} "
                             f"classes of dataset.json; `fastpipe inspect --verify` lists every such sample")
        return label

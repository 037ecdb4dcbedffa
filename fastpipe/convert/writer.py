"""Deterministic WebDataset shards with a DALI index beside each, written atomically.

Why not webdataset's TarWriter: we need each member's data offset for the `.idx` file, and USTAR headers
with mtime 0 make shards byte-identical across runs and ~2x cheaper to read than PAX headers (docs/design.md).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from fastpipe.dataset.manifest import ShardInfo
from fastpipe.dataset.shardformat import BLOCK, index_line, member_chunk, sample_bytes, write_index
from fastpipe.util import signals_deferred


@dataclass
class _Open:
    tmp: Path
    final: Path
    fh: object
    sha: object
    offset: int = 0
    samples: int = 0
    idx_lines: list[str] | None = None
    group: int | None = None


class ShardWriter:
    """Writes `{prefix}-{n:06d}.tar` shards up to `max_bytes`, each with its `.idx`; a sample of another `group`
    than the shard's first starts a new shard too (the converter's --min-shards).

    A shard becomes visible under its final name only once complete (write to `.tmp`, fsync, rename), so an
    interrupted run never leaves a shard that looks finished. `on_close(ShardInfo)` is called after rename.
    """

    def __init__(self, folder: Path, prefix: str, max_bytes: int, first_index: int = 0, on_close=None):
        self.folder, self.prefix, self.max_bytes = Path(folder), prefix, max_bytes
        self.next_index, self.on_close = first_index, on_close
        self.current: _Open | None = None
        self.closed: list[ShardInfo] = []

    def _start(self) -> _Open:
        final = self.folder / f"{self.prefix}-{self.next_index:06d}.tar"
        tmp = final.with_name(final.name + ".tmp")
        self.next_index += 1
        return _Open(tmp, final, open(tmp, "wb"), hashlib.sha256(), idx_lines=[])

    def write(self, key: str, parts: dict[str, bytes], group: int | None = None) -> None:
        """Append one sample (`{key}.{ext}` members in the given order)."""
        size = sample_bytes(parts)
        cur = self.current
        if cur is not None and cur.samples and (cur.offset + size + 2 * BLOCK > self.max_bytes or group != cur.group):
            self.finish()
            cur = None
        if cur is None:
            with signals_deferred():  # its .tmp file exists only once abort() can find it
                cur = self.current = self._start()
            cur.group = group
        fields = []
        for ext, data in parts.items():
            name = f"{key}.{ext}"
            chunk = member_chunk(name, data)
            fields.append((ext, cur.offset + BLOCK, len(data), name))
            cur.fh.write(chunk)
            cur.sha.update(chunk)
            cur.offset += len(chunk)
        cur.idx_lines.append(index_line(fields))
        cur.samples += 1

    def finish(self) -> ShardInfo | None:
        with signals_deferred():  # Ctrl-C while a shard closes: after it is closed and journaled, not half way
            return self._finish()

    def _finish(self) -> ShardInfo | None:
        cur, self.current = self.current, None
        if cur is None:
            return None
        end = b"\0" * (2 * BLOCK)  # tar's end-of-archive marker
        cur.fh.write(end)
        cur.sha.update(end)
        cur.fh.flush()
        os.fsync(cur.fh.fileno())
        cur.fh.close()
        idx = cur.final.with_suffix(".idx")
        write_index(idx, cur.idx_lines)
        os.replace(cur.tmp, cur.final)
        info = ShardInfo(cur.final.name, cur.samples, cur.offset + len(end), cur.sha.hexdigest(), idx.name)
        self.closed.append(info)
        if self.on_close:
            self.on_close(info)
        return info

    def abort(self) -> None:
        if self.current is not None:
            self.current.fh.close()
            self.current.tmp.unlink(missing_ok=True)
            self.current = None

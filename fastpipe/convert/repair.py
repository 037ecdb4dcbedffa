"""`fastpipe inspect --verify --repair`: the undecodable samples a verify found, left out of their shards' `.idx`
files (DALI's reader reads what an index lists and cannot skip a sample), and dataset.json's counts updated; the
samples left out are listed in repaired.jsonl. The tars are not touched.

In a store (a URL) the same files are written in a staging folder, then uploaded: the indexes and repaired.jsonl,
then dataset.json last, as `fastpipe shard` does, so a reader finds the old set or the new one. The shards' bytes
do not change there, nor their sha256; a node cache holding one under its old index starts that copy again
(cache.py). One repair of a store at a time: unlike a local folder's, a store's writers take no lock.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest, SplitInfo, save
from fastpipe.dataset.shardformat import (
    decode_label,
    entry_line,
    parse_index,
    read_index,
    read_member,
    sha256_file,
    write_index,
)
from fastpipe.util import FolderLock, parse_json, write_jsonl_atomic

REPAIRED = "repaired.jsonl"


def repair_indexes(m: Manifest, bad: list[dict], shard_file) -> list[str]:
    """Leave `bad` (inspect's findings: split, shard, key, label) out of their indexes. `shard_file(shard)` is a
    local file holding the shard's bytes at their offsets (a recount of labels reads it)."""
    if m.files.folder is not None:  # rewritten in place, under the folder's lock
        with FolderLock(m.root, "fastpipe inspect --repair"):
            # the samples still listed were all just decoded: a local shard altered since conversion gets its new
            # sha256 (shards read from a store, an index kept here, are what the store has: checked as fetched)
            return _repair(m, bad, m.root, shard_file, rehash=m.files.cache is None)
    r = m.files
    changed = {b["shard"] for b in bad}
    indexes = [s.index for sp in m.splits.values() for s in sp.shards if s.path in changed]
    with tempfile.TemporaryDirectory(prefix="fastpipe-repair-") as tmp:
        staging = Path(tmp)
        for rel in indexes:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        r.get_many([(rel, staging / rel) for rel in indexes] + ([(REPAIRED, staging / REPAIRED)]
                                                                if r.exists(REPAIRED) else []))
        lines = _repair(m, bad, staging, shard_file, rehash=False)
        r.put_many([(staging / rel, rel) for rel in [*indexes, REPAIRED]])
        r.put_many([(staging / MANIFEST_NAME, MANIFEST_NAME)])  # last: it names the new counts
    return lines


def _repair(m: Manifest, bad: list[dict], folder: Path, shard_file, rehash: bool) -> list[str]:
    """Rewrite, in `folder`, the indexes of the shards with bad samples, repaired.jsonl and dataset.json."""
    by_shard: dict[str, set[str]] = {}
    for b in bad:
        by_shard.setdefault(b["shard"], set()).add(b["key"])

    def entries(s):  # a rewritten index is in `folder`; in a store, the others are read from there
        local = folder / s.index
        if local.exists():
            return read_index(local, s.bytes)
        return parse_index(m.files.cat(s.index), m.files.join(s.index), s.bytes)

    splits = {}
    for name, sp in m.splits.items():
        counts, shards = list(sp.class_counts), []
        for s in sp.shards:
            drop = by_shard.get(s.path, set())
            if drop:
                kept = [(k, p) for k, p in entries(s) if k not in drop]
                write_index(folder / s.index, [entry_line(k, p) for k, p in kept])
                s = replace(s, samples=len(kept), sha256=sha256_file(shard_file(s)) if rehash else s.sha256)
            shards.append(s)
        mine = [b for b in bad if b["split"] == name]
        if m.multilabel or any(b["label"] is None or not 0 <= b["label"] < len(counts) for b in mine):
            counts = _recount(m, shards, entries, shard_file)  # a label we could not read: count the kept again
        else:
            for b in mine:
                counts[b["label"]] -= 1
        splits[name] = SplitInfo(tuple(shards), tuple(counts))
    previous = _previous_repairs(folder / REPAIRED)
    write_jsonl_atomic(folder / REPAIRED, previous + bad)
    save(replace(m, splits=splits, settings={**m.settings, "repaired": len(previous) + len(bad)}), folder)
    uploaded = m.files.folder is None
    return [f"  repaired: {len(bad)} samples left out of {len(by_shard)} index files (listed in "
            f"{m.files.join(REPAIRED)}); dataset.json counts updated"
            + (f", uploaded to {m.location} (dataset.json last)" if uploaded else "")]


def _recount(m: Manifest, shards, entries, shard_file) -> list[int]:
    label_ext = m.components.label_bin or m.components.label
    counts = [0] * m.num_classes
    for s in shards:
        with open(shard_file(s), "rb") as fh:
            for _key, parts in entries(s):
                label = decode_label(read_member(fh, parts[label_ext]), label_ext, m.multilabel)
                for k in label if m.multilabel else (label,):
                    counts[k] += 1
    return counts


def _previous_repairs(path: Path) -> list[dict]:
    return [parse_json(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


__all__ = ["REPAIRED", "repair_indexes"]

"""`fastpipe inspect OUT [--verify [--repair]]`: what a converted data set holds, whether it is intact, and the
repair DALI needs (it cannot skip an undecodable sample; its reader reads only what the `.idx` lists).

OUT may be a URL: `--verify` then reads every shard through the node's cache (cache.py checks each against its
sha256 as it completes) and decodes every sample. `--repair` rewrites index files, so it takes a local copy."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from fastpipe.errors import ConfigError, DataError
from fastpipe.manifest import Manifest, SplitInfo, load, save
from fastpipe.shardformat import (
    BLOCK,
    decode_label,
    entry_line,
    parse_index,
    read_index,
    read_member,
    sha256_file,
    write_index,
)
from fastpipe.util import FolderLock, write_jsonl_atomic


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bad: list[dict] = field(default_factory=list)  # undecodable samples: shard, key, label, reason
    altered: list[str] = field(default_factory=list)  # shards whose bytes differ from their checksum
    repaired: bool = False

    @property
    def ok(self) -> bool:
        bad_shards = {b["shard"] for b in self.bad}
        unexplained = [a for a in self.altered if not (self.repaired and a in bad_shards)]
        return not self.problems and not unexplained and (not self.bad or self.repaired)


def _summary(m: Manifest) -> list[str]:
    lines = [f"{m.location}: {m.num_classes} classes"]
    for name, sp in m.splits.items():
        size = sum(s.bytes for s in sp.shards) / 1e6
        lines.append(f"  {name:5s} {sp.samples:7d} samples in {len(sp.shards)} shards, {size:.1f} MB")
    train = m.splits.get("train")
    if m.multilabel:
        lines.append("  multi-label: the counts are images carrying each label; 'weight' is BCE's pos_weight")
    if train and train.samples:
        weights = m.pos_weight() if m.multilabel else m.class_weights()
        lines.append(f"  {'class':24s} {'train':>7s} {'val':>6s} {'weight':>7s}")
        val = m.splits.get("val")
        for i, c in enumerate(m.classes):
            v = val.class_counts[i] if val and val.class_counts else 0
            lines.append(f"  {c[:24]:24s} {train.class_counts[i]:7d} {v:6d} {weights[i]:7.2f}")
        nz = [c for c in train.class_counts if c]
        lines.append(f"  imbalance (largest / smallest class): {max(nz) / min(nz):.1f} : 1")
    lines.append("  mean " + " ".join(f"{x:.4f}" for x in m.mean) + "   std " + " ".join(f"{x:.4f}" for x in m.std))
    if m.settings.get("short_side"):
        lines.append(f"  stored short side {m.settings['short_side']} px, JPEG quality {m.settings['quality']}")
    rejected = _rejected(m)
    if rejected is not None:
        lines.append(f"  rejected at conversion: {len(rejected.splitlines())} (see {m.location}/rejected.jsonl)")
    if m.settings.get("repaired"):
        lines.append(f"  left out by `inspect --repair`: {m.settings['repaired']} (see {m.location}/repaired.jsonl)")
    return lines


def _rejected(m: Manifest) -> str | None:
    """rejected.jsonl's text, where the conversion left one."""
    if m.remote is None:
        path = m.root / "rejected.jsonl"
        return path.read_text() if path.exists() else None
    try:
        return m.remote.cat("rejected.jsonl").decode("utf-8", "replace")
    except DataError:  # not there (an adopted set), or the store refuses it: the summary goes on without it
        return None


def _check_sample(m: Manifest, fh, parts: dict) -> tuple[int | None, str | None]:
    """(label, problem): the image must decode and the label must name one of the classes."""
    label_ext = m.components.label_bin or m.components.label
    label = None
    try:
        label = decode_label(read_member(fh, parts[label_ext]), label_ext, m.multilabel)
        bad = [k for k in (label if m.multilabel else (label,)) if not 0 <= k < m.num_classes]
        if bad:
            return None, f"label {bad[0]} is outside the {m.num_classes} classes"
        Image.open(io.BytesIO(read_member(fh, parts[m.components.image]))).load()
    except Exception as e:  # any failure here is a finding to report, not a crash
        return label, f"{type(e).__name__}: {e}"
    return label, None


def _verify_shard(m: Manifest, split: str, shard, report: Report) -> int:
    tar = m.root / shard.path
    if not tar.is_file():
        report.problems.append(f"{tar}: missing")
        return 0
    if tar.stat().st_size != shard.bytes:
        report.problems.append(f"{tar}: {tar.stat().st_size} bytes, dataset.json says {shard.bytes} (truncated or "
                               f"altered): copy it again")
        return 0
    altered = sha256_file(tar) != shard.sha256
    if altered:  # same size, other bytes: find out which samples still decode
        report.altered.append(shard.path)
    try:
        samples = read_index(m.root / shard.index, shard.bytes)
    except (DataError, OSError) as e:
        report.problems.append(str(e))
        return 0
    return _check_samples(m, split, shard, tar, tar, samples, report)


def _check_samples(m: Manifest, split: str, shard, path: Path, where, samples: list, report: Report) -> int:
    """Every sample of a shard whose bytes are at `path` (`where` names the shard in messages)."""
    if len(samples) != shard.samples:
        report.problems.append(f"{where}: index lists {len(samples)} samples, manifest {shard.samples}")
    with open(path, "rb") as fh:
        for key, parts in samples:
            label, problem = _check_sample(m, fh, parts)
            if problem:
                report.bad.append({"split": split, "shard": shard.path, "key": key, "label": label,
                                   "reason": problem[:300]})
    return len(samples)


def _verify_remote_shard(m: Manifest, split: str, shard, report: Report) -> int:
    """A shard in a store, read whole into the node cache the loaders share (the same file and spans; cache.py
    checks it against its sha256 as it completes, fetching a bad copy once more), then every sample decoded."""
    from fastpipe.cache import ShardCache, tiling

    r = m.remote
    exts = [e for e in (m.components.image, m.components.label_bin or m.components.label, m.components.meta) if e]
    try:
        samples = parse_index(r.cat(shard.index), r.join(shard.index), shard.bytes)
        ends = np.array([max(sum(parts[e]) for e in exts if e in parts) for _, parts in samples], np.int64)
        heads = np.array([(parts[exts[0]][0] - BLOCK, parts[exts[0]][1]) if exts[0] in parts else (-1, -1)
                          for _, parts in samples], np.int64)  # a sample without an image is reported below
        cache = ShardCache(r, r.cache_dir, r.cache_limit, [shard.path], [shard.bytes], [shard.sha256],
                           [tiling(ends, shard.bytes)], [heads.reshape(-1, 2)])
        cache.check(0)
        cache.ensure({0: np.arange(len(samples))})
    except DataError as e:  # missing, still failing after the retries, or not the bytes dataset.json names
        report.problems.append(str(e))
        return 0
    # the cached file holds the shard's bytes at their own offsets (then the cache's presence bytes)
    return _check_samples(m, split, shard, cache.path(0), r.join(shard.path), samples, report)


def inspect(out, verify: bool = False, repair: bool = False, storage_options: dict | None = None,
            cache_dir=None) -> Report:
    m = load(out, storage_options, cache_dir)
    if m.remote is not None and repair:
        raise ConfigError(f"--repair rewrites index files, which fastpipe does not do in a store: copy {m.location} "
                          f"to a local folder (e.g. `aws s3 sync`), repair it there, and upload it again")
    report = Report(_summary(m))
    if verify or repair:
        shards = [(name, s) for name, sp in m.splits.items() for s in sp.shards]
        verify_shard = _verify_shard if m.remote is None else _verify_remote_shard
        checked = sum(verify_shard(m, n, s, report) for n, s in tqdm(shards, desc="verifying", unit="shard"))
        found = len(report.problems) + len(report.bad) + len(report.altered)
        report.lines.append(f"verified {checked} samples in {len(shards)} shards: "
                            + (f"{found} problems" if found else "all intact"))
        report.lines += [f"  PROBLEM {p}" for p in report.problems[:50]]
        report.lines += [f"  PROBLEM {a}: checksum differs from dataset.json (altered since conversion)"
                         for a in report.altered[:50]]
        report.lines += [f"  PROBLEM {b['shard']} sample {b['key']}: {b['reason']}" for b in report.bad[:50]]
        if repair and report.bad:
            report.lines += repair_indexes(m, report.bad)
            report.repaired = True
        elif report.bad:
            where = m.location if m.remote is None else "a local copy of it"
            report.lines.append(f"  {len(report.bad)} undecodable samples: the torch and nvjpeg backends skip them, "
                                f"DALI stops. `fastpipe inspect --repair` of {where} leaves them out of the .idx "
                                f"files (the shards stay as they are)")
    return report


def repair_indexes(m: Manifest, bad: list[dict]) -> list[str]:
    """Rewrite the `.idx` of each shard with bad samples without them, and dataset.json with the new counts;
    the samples left out are listed in repaired.jsonl. The tars are not touched (their checksums still hold)."""
    with FolderLock(m.root, "fastpipe inspect --repair"):
        by_shard: dict[str, set[str]] = {}
        for b in bad:
            by_shard.setdefault(b["shard"], set()).add(b["key"])
        splits = {}
        for name, sp in m.splits.items():
            counts, shards = list(sp.class_counts), []
            for s in sp.shards:
                drop = by_shard.get(s.path, set())
                if drop:
                    kept = [(k, p) for k, p in read_index(m.root / s.index, s.bytes) if k not in drop]
                    write_index(m.root / s.index, [entry_line(k, p) for k, p in kept])
                    # Every sample still listed was just decoded: the shard's new bytes are its checksum now.
                    s = replace(s, samples=len(kept), sha256=sha256_file(m.root / s.path))
                shards.append(s)
            mine = [b for b in bad if b["split"] == name]
            if m.multilabel or any(b["label"] is None or not 0 <= b["label"] < len(counts) for b in mine):
                counts = _recount(m, shards)  # a label we could not read: count the kept samples again
            else:
                for b in mine:
                    counts[b["label"]] -= 1
            splits[name] = SplitInfo(tuple(shards), tuple(counts))
        previous = _previous_repairs(m.root)
        write_jsonl_atomic(m.root / "repaired.jsonl", previous + bad)
        settings = {**m.settings, "repaired": len(previous) + len(bad)}
        save(replace(m, splits=splits, settings=settings))
    return [f"  repaired: {len(bad)} samples left out of {len(by_shard)} index files "
            f"(listed in {m.root / 'repaired.jsonl'}); dataset.json counts updated"]


def _recount(m: Manifest, shards) -> list[int]:
    label_ext = m.components.label_bin or m.components.label
    counts = [0] * m.num_classes
    for s in shards:
        with open(m.root / s.path, "rb") as fh:
            for _key, parts in read_index(m.root / s.index, s.bytes):
                label = decode_label(read_member(fh, parts[label_ext]), label_ext, m.multilabel)
                for k in label if m.multilabel else (label,):
                    counts[k] += 1
    return counts


def _previous_repairs(root: Path) -> list[dict]:
    path = root / "repaired.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

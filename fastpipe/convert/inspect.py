"""`fastpipe inspect OUT [--verify [--repair]]`: what a converted data set holds, whether it is intact, and the
repair DALI needs (it cannot skip an undecodable sample; its reader reads only what the `.idx` lists).

OUT may be a URL: `--verify` then reads every shard through the node's cache (cache.py checks each against its
sha256 as it completes) and decodes every sample; `--repair` (repair.py) uploads the indexes it rewrites."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from fastpipe.convert.repair import repair_indexes
from fastpipe.dataset import imageguard, nearcopy
from fastpipe.dataset.loading import load
from fastpipe.dataset.manifest import Manifest
from fastpipe.dataset.shardformat import (
    BLOCK,
    decode_label,
    parse_index,
    range_as_indexed,
    read_index,
    read_member,
    sha256_file,
)
from fastpipe.errors import DataError

MAX_REJECTED = 256 << 20  # bytes of rejected.jsonl read for the summary (about a million rejections)

_BUFFER = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


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
    lines += _near_line(m)
    if m.settings.get("repaired"):
        lines.append(f"  left out by `inspect --repair`: {m.settings['repaired']} (see {m.location}/repaired.jsonl)")
    return lines


def _near_line(m: Manifest) -> list[str]:
    """The near-copy groups the conversion found, or that it did not look for them."""
    near = m.outputs.get("near_duplicates")
    mode = (near or {}).get("mode", m.settings.get("near_duplicates", "group"))
    if near is None:
        return [] if m.foreign else ["  near-copies: not looked for (converted before fastpipe fingerprinted photos; "
                                     "convert again to find them)"]
    if mode == "off":
        return ["  near-copies: not looked for (--near-duplicates off)"]
    text = (f"  near-copies: {near.get('groups', 0)} groups, {near.get('photos', 0)} photos (threshold "
            f"{nearcopy.threshold_of(m.settings, near)} bits; see {m.location}/{near['file']})")
    extra = [f"{near['straddling']} straddle train and val" if near.get("straddling") else "",
             f"{near['label_conflicts']} under different labels" if near.get("label_conflicts") else ""]
    return [text + "".join(f"; {e}" for e in extra if e)]


def _rejected(m: Manifest) -> str | None:
    """rejected.jsonl's text, where the conversion left one."""
    try:
        return m.files.cat("rejected.jsonl", MAX_REJECTED).decode("utf-8", "replace")
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
        data = read_member(fh, parts[m.components.image])
        imageguard.check(data, imageguard.data_set_limit(m.settings))  # refused here too: --repair drops it
        Image.open(io.BytesIO(data)).load()
    except Exception as e:  # any failure here is a finding to report, not a crash
        # PIL names the buffer by its address: repaired.jsonl should say the same thing on every run
        return label, f"{type(e).__name__}: {_BUFFER.sub('the image bytes', str(e))}"
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
    """A shard in a store, read whole into the node cache the loaders share, then every sample decoded."""
    try:
        path, samples = _cached_whole(m, shard)
    except DataError as e:  # missing, still failing after the retries, or not the bytes dataset.json names
        report.problems.append(str(e))
        return 0
    return _check_samples(m, split, shard, path, m.files.join(shard.path), samples, report)


def _cached_whole(m: Manifest, shard) -> tuple[Path, list]:
    """(the node cache's file holding the store's shard whole, its index as in the store). The cache uses the
    loaders' files and sample spans (cache.tiling) and checks the shard against its sha256 as it completes,
    fetching a bad copy once more; the file holds the shard's bytes at their own offsets."""
    from fastpipe.store.cache import ShardCache, tiling

    r = m.files
    exts = [e for e in (m.components.image, m.components.label_bin or m.components.label, m.components.meta) if e]
    samples = parse_index(r.cat(shard.index), r.join(shard.index), shard.bytes)
    ends = np.array([max(sum(parts[e]) for e in exts if e in parts) for _, parts in samples], np.int64)
    heads = np.array([(parts[exts[0]][0] - BLOCK, parts[exts[0]][1]) if exts[0] in parts else (-1, -1)
                      for _, parts in samples], np.int64)  # a sample without an image is reported by the check
    cache = ShardCache(r, r.cache.folder, r.cache.limit, [shard.path], [shard.bytes], [shard.sha256],
                       [tiling(ends, shard.bytes)], [heads.reshape(-1, 2)], range_as_indexed)
    cache.check(0)
    cache.ensure({0: np.arange(len(samples))})
    return cache.path(0), samples


def inspect(out, verify: bool = False, repair: bool = False, storage_options: dict | None = None,
            cache_dir=None) -> Report:
    m = load(out, storage_options, cache_dir)
    report = Report(_summary(m))
    if verify or repair:
        shards = [(name, s) for name, sp in m.splits.items() for s in sp.shards]
        verify_shard = _verify_shard if m.files.cache is None else _verify_remote_shard  # a store's: through the cache
        checked = sum(verify_shard(m, n, s, report) for n, s in tqdm(shards, desc="verifying", unit="shard"))
        found = len(report.problems) + len(report.bad) + len(report.altered)
        report.lines.append(f"verified {checked} samples in {len(shards)} shards: "
                            + (f"{found} problems" if found else "all intact"))
        report.lines += [f"  PROBLEM {p}" for p in report.problems[:50]]
        report.lines += [f"  PROBLEM {a}: checksum differs from dataset.json (altered since conversion)"
                         for a in report.altered[:50]]
        report.lines += [f"  PROBLEM {b['shard']} sample {b['key']}: {b['reason']}" for b in report.bad[:50]]
        if repair and report.bad:
            local = (lambda s: m.root / s.path) if m.files.cache is None else (lambda s: _cached_whole(m, s)[0])
            report.lines += repair_indexes(m, report.bad, local)
            report.repaired = True
        elif report.bad:
            report.lines.append(f"  {len(report.bad)} undecodable samples: the torch and nvjpeg backends skip them, "
                                f"DALI stops. `fastpipe inspect --verify --repair {m.location}` leaves them out of "
                                f"the .idx files (the shards stay as they are)")
    return report


def leaks(out, other, threshold: int | None = None, cache_dir=None) -> list[str]:
    """`inspect A --against B`: the lines to print, near-copies.jpg written in the current folder."""
    from pathlib import Path

    from fastpipe.convert import against

    a, b = load(out, None, cache_dir), load(other, None, cache_dir)
    bits = threshold if threshold is not None else nearcopy.threshold_of(a.settings)
    rows = against.against(a, b, bits)
    found = against.lines(rows, a, b, sum(sp.samples for sp in a.splits.values()))
    if rows and against.picture(rows, a, b, Path("near-copies.jpg")):
        found.append(f"  picture: {Path('near-copies.jpg').resolve()} ({min(len(rows), 8)} pairs, A left, B right)")
    return found

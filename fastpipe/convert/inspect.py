"""`fastpipe inspect OUT [--verify]`: what a converted data set holds, and whether it is intact."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from fastpipe.convert.writer import read_index, read_member, sha256_file
from fastpipe.manifest import Manifest, load


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _summary(m: Manifest) -> list[str]:
    lines = [f"{m.root}: {m.num_classes} classes"]
    for name, sp in m.splits.items():
        size = sum(s.bytes for s in sp.shards) / 1e6
        lines.append(f"  {name:5s} {sp.samples:7d} samples in {len(sp.shards)} shards, {size:.1f} MB")
    train = m.splits.get("train")
    if train and train.samples:
        weights = m.class_weights()
        lines.append(f"  {'class':24s} {'train':>7s} {'val':>6s} {'weight':>7s}")
        val = m.splits.get("val")
        for i, c in enumerate(m.classes):
            v = val.class_counts[i] if val and val.class_counts else 0
            lines.append(f"  {c:24s} {train.class_counts[i]:7d} {v:6d} {weights[i]:7.2f}")
        nz = [c for c in train.class_counts if c]
        lines.append(f"  imbalance (largest / smallest class): {max(nz) / min(nz):.1f} : 1")
    lines.append("  mean " + " ".join(f"{x:.4f}" for x in m.mean) + "   std " + " ".join(f"{x:.4f}" for x in m.std))
    if m.settings.get("short_side"):
        lines.append(f"  stored short side {m.settings['short_side']} px, JPEG quality {m.settings['quality']}")
    rejected = m.root / "rejected.jsonl"
    if rejected.exists():
        lines.append(f"  rejected at conversion: {len(rejected.read_text().splitlines())} (see {rejected})")
    return lines


def _verify_shard(m: Manifest, shard, report: Report) -> int:
    tar = m.root / shard.path
    if not tar.is_file():
        report.problems.append(f"{tar}: missing")
        return 0
    if tar.stat().st_size != shard.bytes or sha256_file(tar) != shard.sha256:
        report.problems.append(f"{tar}: checksum differs from dataset.json (altered or truncated)")
    samples = read_index(m.root / shard.index)
    if len(samples) != shard.samples:
        report.problems.append(f"{tar}: index lists {len(samples)} samples, manifest {shard.samples}")
    with open(tar, "rb") as fh:
        for i, sample in enumerate(samples):
            try:
                Image.open(io.BytesIO(read_member(fh, sample[m.components.image]))).load()
                int(read_member(fh, sample[m.components.label]))
            except Exception as e:  # any failure here is a finding to report, not a crash
                report.problems.append(f"{tar} sample {i}: {type(e).__name__}: {e}")
    return len(samples)


def inspect(out: Path, verify: bool = False) -> Report:
    m = load(out)
    report = Report(_summary(m))
    if verify:
        shards = [s for sp in m.splits.values() for s in sp.shards]
        checked = sum(_verify_shard(m, s, report) for s in tqdm(shards, desc="verifying", unit="shard"))
        report.lines.append(f"verified {checked} samples in {len(shards)} shards: "
                            + ("all intact" if report.ok else f"{len(report.problems)} problems"))
        report.lines += [f"  PROBLEM {p}" for p in report.problems[:50]]
    return report

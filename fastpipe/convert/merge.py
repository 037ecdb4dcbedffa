"""`fastpipe merge OUT`: join the manifests of a conversion run as independent `--part i --parts N` jobs.

Each part wrote a disjoint set of shards (`train-{part:03d}-{n:06d}.tar`), its own `dataset.part-*.json`
with raw pixel sums, and its own `rejected.part-*.jsonl`; merging is concatenation and addition, exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastpipe.convert import previews
from fastpipe.manifest import Manifest, ManifestError, SplitInfo, Stats, from_dict, save
from fastpipe.util import FolderLock, local_path, write_jsonl_atomic

PART_RE = re.compile(r"dataset\.part-(\d{3})-of-(\d{3})\.json$")


def _parts(out: Path) -> list[Manifest]:
    found = sorted((int(m.group(1)), int(m.group(2)), p)
                   for p in out.glob("dataset.part-*-of-*.json") if (m := PART_RE.search(p.name)))
    if not found:
        raise ManifestError(f"{out}: no dataset.part-*-of-*.json to merge (run `fastpipe shard --part i --parts N`)")
    n = found[0][1]
    missing = sorted(set(range(n)) - {i for i, _, _ in found})
    if missing or any(k != n for _, k, _ in found):
        raise ManifestError(f"{out}: parts {missing} of {n} are missing or unfinished; run them, then merge again")
    manifests = [from_dict(json.loads(p.read_text()), out) for _, _, p in found]
    base = {k: v for k, v in manifests[0].settings.items() if k not in ("part", "fingerprint")}
    for m in manifests[1:]:
        other = {k: v for k, v in m.settings.items() if k not in ("part", "fingerprint")}
        if other != base or m.classes != manifests[0].classes:
            raise ManifestError(f"{out}: parts were converted with different settings or class lists")
    return manifests


def merge_parts(out: Path) -> Manifest:
    out = local_path(out, "OUT")
    with FolderLock(out, "fastpipe merge"):
        return _merge(out)


def _merge(out: Path) -> Manifest:
    parts = _parts(out)
    splits = {}
    for name in parts[0].splits:
        shards = tuple(s for m in parts for s in m.splits[name].shards)
        counts = tuple(map(sum, zip(*(m.splits[name].class_counts for m in parts))))
        splits[name] = SplitInfo(shards, counts)
    stats = sum((m.stats for m in parts), Stats.zero())
    settings = {k: v for k, v in parts[0].settings.items() if k not in ("part", "fingerprint")}
    settings["fingerprint"] = "merged:" + ",".join(m.settings["fingerprint"][:16] for m in parts)
    manifest = Manifest(parts[0].classes, splits, stats, settings, parts[0].components, out,
                        {"rejected": "rejected.jsonl"}, parts[0].task)
    rejected = [json.loads(line) for p in sorted(out.glob("rejected.part-*-of-*.jsonl"))
                for line in p.read_text().splitlines()]
    write_jsonl_atomic(out / "rejected.jsonl", sorted(rejected, key=lambda r: (r["path"], r["reason"])))
    names = previews.contact_sheets(manifest, out / "previews", seed=settings.get("seed", 0))
    manifest.outputs["previews"] = {c: f"previews/{f}" for c, f in names.items()}
    save(manifest, out)  # last: the merge is complete only when every output is
    return manifest

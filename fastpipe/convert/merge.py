"""`fastpipe merge OUT`: join the manifests of a conversion run as independent `--part i --parts N` jobs.

Each part wrote a disjoint set of shards (`train-{part:03d}-{n:06d}.tar`), its own `dataset.part-*.json`
with raw pixel sums, and its own `rejected.part-*.jsonl`; merging is concatenation and addition, exact.

Parts in a store (`--parts N --part i` into one URL, each uploading its shards, indexes, rejections and part
manifest last): `fastpipe merge URL` downloads only the part manifests and rejection records, fetches the few images
its previews show (each part's manifest holds a uniform sample of each class: previews.candidates), and uploads
rejected.jsonl, the previews and dataset.json (last), through publish.py's staging folder and upload.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from fastpipe.convert import outputs, previews, readers
from fastpipe.convert.publish import staging_folder, upload
from fastpipe.dataset.loading import load
from fastpipe.dataset.manifest import MANIFEST_NAME, Manifest, ManifestError, SplitInfo, Stats, from_dict, save
from fastpipe.store.location import open_location
from fastpipe.store.remote import Remote
from fastpipe.util import FolderLock, atomic_write_bytes, parse_json, read_json, write_jsonl_atomic

PART_RE = re.compile(r"dataset\.part-(\d{3})-of-(\d{3})\.json$")


def _parts(out: Path, where: str | None = None) -> list[Manifest]:
    where = where or str(out)
    found = sorted((int(m.group(1)), int(m.group(2)), p)
                   for p in out.glob("dataset.part-*-of-*.json") if (m := PART_RE.search(p.name)))
    if not found:
        raise ManifestError(f"{where}: no dataset.part-*-of-*.json to merge (run `fastpipe shard --part i --parts N`)")
    n = found[0][1]
    missing = sorted(set(range(n)) - {i for i, _, _ in found})
    if missing or any(k != n for _, k, _ in found):
        raise ManifestError(f"{where}: parts {missing} of {n} are missing or unfinished; run them, then merge again")
    manifests = [from_dict(read_json(p), out) for _, _, p in found]
    base = _shared(manifests[0].settings)
    for m in manifests[1:]:
        if _shared(m.settings) != base or m.classes != manifests[0].classes:
            raise ManifestError(f"{where}: parts were converted with different settings, class lists or source "
                                f"files; convert every part from the same SRC contents with the same options")
    return manifests


def _shared(settings: dict) -> dict:
    """What every part of one job has in common: not its number or fingerprint, nor where its node had SRC (the
    plan hash says the parts saw the same files). Parts written before the plan hash compare SRC's path."""
    drop = {"part", "fingerprint"} | ({"source"} if "plan" in settings else set())
    return {k: v for k, v in settings.items() if k not in drop}


def merge_parts(out) -> Manifest:
    """Merge the parts in folder `out`, or in a store's folder (a URL: merge_to_url)."""
    where = open_location(out, what="OUT")
    if where.folder is None:
        return merge_to_url(where.url)
    out = where.folder
    with FolderLock(out, "fastpipe merge"):
        return merge_in(out, previews.read_local(out))


def merge_in(out: Path, read, where: str | None = None) -> Manifest:
    """Merge the part manifests and rejection records in folder `out`, writing rejected.jsonl, previews and
    dataset.json (last) there; the previews' images are got with `read` (previews.draw). `where` names the
    parts' location in messages (a store's URL when `out` is a staging folder)."""
    parts = _parts(out, where)
    _refuse_foreign_readers(out, parts[0].splits)
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
    rejected = [parse_json(line) for p in sorted(out.glob("rejected.part-*-of-*.jsonl"))
                for line in p.read_text().splitlines()]
    write_jsonl_atomic(out / "rejected.jsonl", sorted(rejected, key=lambda r: (r["path"], r["reason"])))
    near = parts[0].outputs.get("near_duplicates")  # every part planned the whole set: the same groups
    if near is not None and (out / near["file"]).is_file():
        groups = [parse_json(line) for line in (out / near["file"]).read_text().splitlines()]
        write_jsonl_atomic(out / "near-duplicates.jsonl", groups)
        manifest.outputs["near_duplicates"] = {k: v for k, v in near.items() if k not in ("fingerprints", "preview")}
        manifest.outputs["near_duplicates"]["file"] = "near-duplicates.jsonl"
        if "fingerprints" in near and (out / near["fingerprints"]).is_file():
            atomic_write_bytes(out / "fingerprints.npz", (out / near["fingerprints"]).read_bytes())
            manifest.outputs["near_duplicates"]["fingerprints"] = "fingerprints.npz"
    seed = settings.get("seed", 0)
    if all("preview_candidates" in m.outputs for m in parts):
        picked = previews.from_candidates([_candidates(m) for m in parts], manifest.classes, seed)
        names = previews.draw(picked, manifest.classes, out / "previews", read)
    else:  # parts written by an older fastpipe, which recorded no preview candidates: every label read again
        # (local folders only)
        names = previews.contact_sheets(manifest, out / "previews", seed=seed)
    manifest.outputs["previews"] = {c: f"previews/{f}" for c, f in names.items()}
    manifest.outputs["readers"] = readers.write(manifest, out)
    save(manifest, out)  # last: the merge is complete only when every output is
    return manifest


def _refuse_foreign_readers(out: Path, splits) -> None:
    """The reader files the merge writes must be ours already (an earlier merge lists them) or absent."""
    previous, _ = outputs.read_manifest(out / MANIFEST_NAME)
    owned = outputs.manifest_files(previous) if previous is not None else set()
    outputs.refuse_conflicts(out, outputs.foreign_conflicts(out, [], owned, readers.names(splits)))


def _candidates(part: Manifest) -> dict:
    """A part's preview candidates, each checked to lie in one of that part's own shards (a part manifest in a
    store is input like any other)."""
    cands = part.outputs["preview_candidates"]
    own = {s.path for split in part.splits.values() for s in split.shards}
    ok = isinstance(cands, dict) and all(
        isinstance(c, dict) and isinstance(c.get("count"), int) and isinstance(c.get("samples"), list)
        and all(isinstance(x, list) and len(x) == 3 and x[0] in own and all(isinstance(v, int) for v in x[1:])
                for x in c["samples"]) for c in cands.values())
    if not ok:
        raise ManifestError(f"part {part.settings.get('part')}: outputs.preview_candidates is damaged (each "
                            f"sample must be [shard, offset, size] in one of the part's shards); re-run that part")
    return cands


def merge_to_url(url: str, storage_options: dict | None = None):
    """`fastpipe merge URL`: the part manifests and rejection records downloaded into a staging folder, merged there
    (the few images the previews show fetched by their byte ranges), and the results uploaded, dataset.json last.
    No shard is read whole; nothing to resume: a failed merge is run again from the store."""
    url = url.rstrip("/")
    remote = Remote(url, storage_options)
    records = [r for pattern in ("dataset.part-*-of-*.json", "rejected.part-*-of-*.jsonl",
                                 "near-duplicates.part-*-of-*.jsonl", "fingerprints.part-*-of-*.npz")
               for r in remote.glob(pattern)]
    staging = staging_folder(url + "#merge")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    def read(locations):
        return remote.ranges([(rel, off, off + size) for rel, (off, size) in locations])

    try:
        remote.get_many([(n, staging / n) for n in records])
        merge_in(staging, read, where=url)
        upload(staging, remote, skip=set(records))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return load(url, storage_options)

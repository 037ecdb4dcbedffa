"""From discovered files to the ordered sample list of each split: hash, deduplicate, split, shuffle.

Everything here is deterministic for a seed, so that a rerun, a resumed run and every `--part` of a
cluster job compute the same plan independently.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.pool import ThreadPool

import numpy as np
from tqdm import tqdm

from fastpipe.convert import images, photos
from fastpipe.convert.sources import Item, Rejection, Source, original_first


@dataclass(frozen=True)
class Sample:
    pos: int  # position in its split's shuffled order: the sample's key and its place in the shards
    path: str  # relative to the source root
    label: int | tuple[int, ...]  # a class index, or the sorted class indices of a multi-label sample


def hash_files(source: Source, threads: int, pool=None) -> tuple[dict[str, str], list[Rejection], dict[str, int],
                                                                  dict[str, np.ndarray]]:
    """sha256 of every file (one read each; the duplicate check needs it before any decoding), the rejections,
    each file's pixels as its header says, and its near-copy fingerprint where taken (photos.hash_one; set up by
    photos.init_worker).

    Threads, without `pool`: reading and hashlib release the GIL. A store's objects are read 16 at a time at least
    (their latency, not this machine, is what limits). `pool` (the conversion's worker processes, where taking the
    fingerprints converts the photos; Ray's: onray.py) reads and hashes them there instead."""
    where = [source.files.join(i.path) for i in source.items]
    threads = max(threads, source.files.inflight)  # a store's latency, not this machine, limits its reads
    threaded = ThreadPool(threads) if pool is None and threads > 1 else None
    mapper = pool or threaded
    results = mapper.imap(photos.hash_one, where, chunksize=8) if mapper else map(photos.hash_one, where)
    hashes, rejected, pixels, fps = {}, [], {}, {}
    for item, loc, r in tqdm(zip(source.items, where, results), total=len(where), desc="hashing", unit="file",
                             leave=False, mininterval=0.5):
        if isinstance(r, images.Rejected):
            rejected.append(Rejection(item.path, r.reason, r.detail.replace(loc, item.path)))
        elif r[1] == 0:
            rejected.append(Rejection(item.path, "empty", "0 bytes"))
        else:
            hashes[item.path], pixels[item.path] = r[0], r[2]
            if r[3] is not None:
                fps[item.path] = r[3]
    if threaded:
        threaded.close()
    return hashes, rejected, pixels, fps


def deduplicate(items: list[Item], hashes: dict[str, str]) -> tuple[list[Item], list[Rejection]]:
    """One copy per (bytes, label), the original kept (original_first); bytes seen under two labels are all
    refused as a label conflict."""
    groups: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        if item.path in hashes:
            groups[hashes[item.path]].append(item)
    keep, rejected = [], []
    for group in groups.values():
        group.sort(key=lambda i: original_first(i.path))
        labels = sorted({i.label for i in group})
        if len(labels) > 1:
            others = ", ".join(f"{i.path} ({i.label})" for i in group)
            rejected += [Rejection(i.path, "label-conflict", f"same bytes as: {others}") for i in group]
            continue
        keep.append(group[0])
        rejected += [Rejection(i.path, "duplicate", f"same bytes as {group[0].path}") for i in group[1:]]
    keep.sort(key=lambda i: i.path)
    return keep, rejected


def _stratum(items: list[Item], multilabel: bool):
    """What the split is stratified by: the class; for a label set, its rarest label (the usual heuristic: exact
    label sets are often too small to split, and the rare labels are the ones a val split must not lose)."""
    if not multilabel:
        return lambda i: i.label
    freq: dict[str, int] = defaultdict(int)
    for i in items:
        for n in i.label.split(";"):
            freq[n] += 1
    return lambda i: min(i.label.split(";"), key=lambda n: (freq[n], n))


def split_items(items: list[Item], val_fraction: float, seed: int, multilabel: bool = False,
                groups=()) -> dict[str, list[Item]]:
    """Source-given split if there is one, else stratified per class: round(n * fraction) to val, at least one when
    a class has two or more files and the fraction is above zero. A group of near-copies (nearplan.Group) goes to
    one split whole: the class's photos are taken group by group in a seeded order, a group to val while it fits in
    the val count (without groups: the first round(n * fraction) photos of that order, as before groups existed)."""
    from fastpipe.convert.nearplan import units

    if any(i.split for i in items):
        return {s: [i for i in items if i.split == s] for s in ("train", "val")}
    by_class: dict[str, list[list[Item]]] = defaultdict(list)
    stratum = _stratum(items, multilabel)
    for u in units(items, list(groups)):
        by_class[stratum(u[0])].append(u)
    rng = np.random.default_rng(seed)
    out: dict[str, list[Item]] = {"train": [], "val": []}
    for label in sorted(by_class):
        group = by_class[label]
        n = sum(len(u) for u in group)
        n_val = round(n * val_fraction)
        if val_fraction > 0 and n >= 2:
            n_val = min(max(n_val, 1), n - 1)
        taken = 0
        for j in rng.permutation(len(group)):
            fits = taken + len(group[j]) <= n_val
            out["val" if fits else "train"] += group[j]
            taken += len(group[j]) if fits else 0
    return out


def order_split(items: list[Item], classes: tuple[str, ...], seed: int, salt: int,
                multilabel: bool = False) -> list[Sample]:
    """Global seeded shuffle, so that every shard mixes classes."""
    index = {c: k for k, c in enumerate(classes)}

    def label(item: Item):
        if multilabel:
            return tuple(sorted(index[n] for n in item.label.split(";") if n))
        return index[item.label]

    perm = np.random.default_rng([seed, salt]).permutation(len(items))
    return [Sample(pos, items[j].path, label(items[j])) for pos, j in enumerate(perm)]


def part_range(n: int, part: int, parts: int) -> range:
    """Contiguous slice `part` of `parts` (sizes differ by at most one)."""
    return range(n * part // parts, n * (part + 1) // parts)


def fingerprints(settings: dict, ordered: dict[str, list[Sample]], mine: dict[str, list[Sample]],
                 hashes: dict[str, str]) -> tuple[str, str, str]:
    """(this part's plan, the same as fastpipe computed it before leaving SRC's path out, the whole job's plan).

    The first changes when a setting, the file list (paths under SRC), a label or a file's bytes change; not when
    SRC is mounted elsewhere, as on the machine that resumes a lost one's conversion or on each node of a cluster
    job. The second keeps an output written before that change up to date. The third is the same for every part
    of a cluster job (all parts' samples, the settings but the part): a merge checks that its parts saw the same
    files."""
    common = {k: v for k, v in settings.items() if k != "source"}
    return (_digest(common, mine, hashes), _digest(settings, mine, hashes),
            _digest({k: v for k, v in common.items() if k != "part"}, ordered, hashes))


def _digest(settings: dict, splits: dict[str, list[Sample]], hashes: dict[str, str]) -> str:
    h = hashlib.sha256(repr(sorted(settings.items())).encode())
    for name in sorted(splits):
        for s in splits[name]:
            h.update(f"{name}\0{s.pos}\0{s.path}\0{s.label}\0{hashes[s.path]}\n".encode())
    return h.hexdigest()

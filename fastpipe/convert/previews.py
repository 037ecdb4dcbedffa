"""Contact sheets: 3x3 random samples per class, the quickest check that labels mean what they say."""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastpipe.manifest import Manifest
from fastpipe.shardformat import decode_label, read_index, read_member
from fastpipe.util import atomic_write_bytes

CELL = 220
TITLE = 28


def preview_names(classes) -> dict[str, str]:
    """A distinct, safe file name per class: the name itself when it is plain ASCII, else a readable slug plus a
    hash of the exact name, so that 'a b', 'a/b', 'a_b', '猫' and '犬' never share a file and '..' or a
    300-character label cannot escape the folder or exceed a name limit."""
    names = {}
    for c in classes:
        slug = re.sub(r"[^\w-]+", "_", c, flags=re.ASCII).strip("_")[:60]
        if slug != c:
            slug = f"{slug or 'class'}-{hashlib.sha1(c.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
        names[c] = f"{slug}.jpg"
    return names


def _locate_by_class(manifest: Manifest) -> dict[int, list[tuple[Path, tuple[int, int]]]]:
    """Where each class's images are: (shard, (offset, size)) read through the .idx files."""
    comp = manifest.components
    label_ext = comp.label_bin or comp.label
    found = defaultdict(list)
    for split in manifest.splits.values():
        for shard in split.shards:
            tar = manifest.root / shard.path
            with open(tar, "rb") as fh:
                for _key, sample in read_index(manifest.root / shard.index, shard.bytes):
                    if comp.image in sample and label_ext in sample:
                        with contextlib.suppress(ValueError):  # inspect --verify reports a bad label
                            label = decode_label(read_member(fh, sample[label_ext]), label_ext, manifest.multilabel)
                            for k in label if manifest.multilabel else (label,):  # a label set: every class
                                found[k].append((tar, sample[comp.image]))
    return found


def _tile(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (CELL, CELL))
    im = im.convert("RGB")
    im.thumbnail((CELL, CELL), Image.Resampling.BILINEAR)  # antialiased when shrinking; 1.7 ms a tile, bicubic 2.7
    return im


def _sheet(job: tuple[str, int, list[tuple[str, tuple[int, int]]], int]) -> bytes:
    """One class's contact sheet as JPEG bytes. `job`: the class name, its sample count, the picked samples'
    locations, the side of the grid."""
    name, count, picked, side = job
    sheet = Image.new("RGB", (side * CELL, side * CELL + TITLE), (30, 30, 30))
    ImageDraw.Draw(sheet).text((8, 8), f"{name[:60]}  ({count} samples, {len(picked)} shown)", fill=(240, 240, 240))
    for i, (tar, loc) in enumerate(picked):
        try:
            with open(tar, "rb") as fh:
                tile = _tile(read_member(fh, loc))
        except (OSError, ValueError, SyntaxError):
            continue  # an undecodable sample: the loaders skip it, inspect --verify names it
        x, y = (i % side) * CELL, (i // side) * CELL + TITLE
        sheet.paste(tile, (x + (CELL - tile.width) // 2, y + (CELL - tile.height) // 2))
    buf = io.BytesIO()
    sheet.save(buf, "JPEG", quality=85)
    return buf.getvalue()


def contact_sheets(manifest: Manifest, folder: Path, seed: int = 0, per_class: int = 9, pool=None) -> dict[str, str]:
    """Write folder/<file>.jpg for each class; returns {class: file name} (also recorded in dataset.json). With
    `pool` (the converter's processes, idle by now), the sheets are drawn in parallel."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    found = _locate_by_class(manifest)
    names = preview_names(manifest.classes)
    side = int(np.ceil(np.sqrt(per_class)))
    jobs = []
    for label, name in enumerate(manifest.classes):
        where = found.get(label, [])
        picks = rng.choice(len(where), size=min(per_class, len(where)), replace=False) if where else []
        jobs.append((name, len(where), [(str(where[j][0]), where[j][1]) for j in picks], side))
    for (name, *_), data in zip(jobs, pool.imap(_sheet, jobs) if pool else map(_sheet, jobs)):
        atomic_write_bytes(folder / names[name], data)
    return names

"""Contact sheets: 3x3 random samples per class, the quickest check that labels mean what they say."""

from __future__ import annotations

import io
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastpipe.convert.writer import read_index, read_member
from fastpipe.manifest import Manifest

CELL = 220
TITLE = 28


def _locate_by_class(manifest: Manifest) -> dict[int, list[tuple[Path, tuple[int, int]]]]:
    """Where each class's images are: (shard, (offset, size)) read through the .idx files."""
    comp = manifest.components
    found = defaultdict(list)
    for split in manifest.splits.values():
        for shard in split.shards:
            tar = manifest.root / shard.path
            with open(tar, "rb") as fh:
                for sample in read_index(manifest.root / shard.index):
                    if comp.image in sample and comp.label in sample:
                        label = int(read_member(fh, sample[comp.label]).decode().strip())
                        found[label].append((tar, sample[comp.image]))
    return found


def _tile(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (CELL, CELL))
    im = im.convert("RGB")
    im.thumbnail((CELL, CELL))
    return im


def contact_sheets(manifest: Manifest, folder: Path, seed: int = 0, per_class: int = 9) -> list[Path]:
    """Write previews/<class>.jpg for each class; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    found = _locate_by_class(manifest)
    side = int(np.ceil(np.sqrt(per_class)))
    written = []
    for label, name in enumerate(manifest.classes):
        where = found.get(label, [])
        picks = rng.choice(len(where), size=min(per_class, len(where)), replace=False) if where else []
        sheet = Image.new("RGB", (side * CELL, side * CELL + TITLE), (30, 30, 30))
        ImageDraw.Draw(sheet).text((8, 8), f"{name}  ({len(where)} samples, {len(picks)} shown)",
                                   fill=(240, 240, 240))
        for i, j in enumerate(picks):
            tar, loc = where[j]
            with open(tar, "rb") as fh:
                tile = _tile(read_member(fh, loc))
            x, y = (i % side) * CELL, (i // side) * CELL + TITLE
            sheet.paste(tile, (x + (CELL - tile.width) // 2, y + (CELL - tile.height) // 2))
        path = folder / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.jpg"
        sheet.save(path, quality=85)
        written.append(path)
    return written

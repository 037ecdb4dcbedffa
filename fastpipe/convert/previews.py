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

from fastpipe.dataset import imageguard
from fastpipe.dataset.manifest import Manifest
from fastpipe.dataset.shardformat import decode_label, read_index, read_member
from fastpipe.util import atomic_write_bytes

CELL = 220
TITLE = 28
GAP = 6  # background between tiles: two photos side by side read as one otherwise


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


def _locate_by_class(manifest: Manifest) -> dict[int, list[tuple[str, tuple[int, int]]]]:
    """Where each class's images are: (shard path in the set, (offset, size)) read through the .idx files."""
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
                                found[k].append((shard.path, sample[comp.image]))
    return found


def _tile(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (CELL, CELL))
    im = im.convert("RGB")
    im.thumbnail((CELL, CELL), Image.Resampling.BILINEAR)  # antialiased when shrinking, and cheaper than bicubic
    return im


def _sheet(job: tuple[str, int, list[bytes], int, int]) -> bytes:
    """One class's contact sheet as JPEG bytes. `job`: the class name, its sample count, the picked images' bytes,
    the side of the grid, the data set's max_pixels (an image whose header does not pass imageguard.check is not
    decoded: an empty tile)."""
    name, count, images, side, max_pixels = job
    sheet = Image.new("RGB", (GAP + side * (CELL + GAP), TITLE + side * (CELL + GAP)), (30, 30, 30))
    ImageDraw.Draw(sheet).text((8, 8), f"{name[:60]}  ({count} samples, {len(images)} shown)", fill=(240, 240, 240))
    for i, data in enumerate(images):
        try:
            imageguard.check(data, max_pixels)
            tile = _tile(data)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            continue  # an undecodable sample: the loaders skip it, inspect --verify names it
        x, y = GAP + (i % side) * (CELL + GAP), TITLE + (i // side) * (CELL + GAP)
        sheet.paste(tile, (x + (CELL - tile.width) // 2, y + (CELL - tile.height) // 2))
    buf = io.BytesIO()
    sheet.save(buf, "JPEG", quality=85)
    return buf.getvalue()


def read_local(root: Path):
    """`read` for contact sheets of shards in a folder: [(shard path, (offset, size))] -> their bytes."""
    def read(locations):
        out = []
        for rel, loc in locations:
            try:
                with open(root / rel, "rb") as fh:
                    out.append(read_member(fh, loc))
            except (OSError, ValueError):
                out.append(b"")  # drawn as an empty tile
        return out
    return read


def _pick(found: dict, classes, rng, per_class: int) -> list[tuple[int, list]]:
    """(count, picked locations) per class, uniformly without replacement."""
    out = []
    for label in range(len(classes)):
        where = found.get(label, [])
        picks = rng.choice(len(where), size=min(per_class, len(where)), replace=False) if where else []
        out.append((len(where), [where[j] for j in picks]))
    return out


def candidates(manifest: Manifest, seed: int, part: int, per_class: int = 9) -> dict[str, dict]:
    """A part of a cluster conversion: per class its sample count and a uniform random sample of its images'
    locations, recorded in the part's manifest, so that `merge` draws the data set's previews without reading
    every shard's labels again (or, for a store, without fetching them)."""
    picked = _pick(_locate_by_class(manifest), manifest.classes, np.random.default_rng([seed, part]), per_class)
    return {str(k): {"count": n, "samples": [[rel, *loc] for rel, loc in where]} for k, (n, where) in enumerate(picked)}


def from_candidates(parts: list[dict], classes, seed: int, per_class: int = 9) -> list[tuple[int, list]]:
    """(count, picked locations) per class from the parts' candidates: a uniform sample of the whole class, as
    the number taken from each part is drawn multivariate-hypergeometrically from the parts' counts and each
    part's candidates are a uniform random sample of its own."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(len(classes)):
        counts = [p.get(str(k), {}).get("count", 0) for p in parts]
        take = rng.multivariate_hypergeometric(counts, min(per_class, sum(counts))) if sum(counts) else [0] * len(parts)
        out.append((sum(counts), [(s[0], (s[1], s[2])) for p, t in zip(parts, take)
                                  for s in p.get(str(k), {}).get("samples", [])[:t]]))
    return out


def draw(picked: list[tuple[int, list]], classes, folder: Path, read, pool=None, per_class: int = 9,
         max_pixels: int = imageguard.DEFAULT_MAX_PIXELS) -> dict[str, str]:
    """Write folder/<file>.jpg for each class from (count, locations) per class, the images' bytes got by `read`
    (one call: a store fetches them together); returns {class: file name}. With `pool` (the converter's
    processes, idle by now), the sheets are drawn in parallel."""
    folder.mkdir(parents=True, exist_ok=True)
    names = preview_names(classes)
    side = int(np.ceil(np.sqrt(per_class)))
    images = iter(read([loc for _, where in picked for loc in where]))
    jobs = [(name, n, [next(images) for _ in where], side, max_pixels) for name, (n, where) in zip(classes, picked)]
    for (name, *_), data in zip(jobs, pool.imap(_sheet, jobs) if pool else map(_sheet, jobs)):
        atomic_write_bytes(folder / names[name], data)
    return names


def contact_sheets(manifest: Manifest, folder: Path, seed: int = 0, per_class: int = 9, pool=None) -> dict[str, str]:
    """Previews of a local data set: `per_class` random images of each class."""
    picked = _pick(_locate_by_class(manifest), manifest.classes, np.random.default_rng(seed), per_class)
    return draw(picked, manifest.classes, folder, read_local(manifest.root), pool, per_class,
                imageguard.data_set_limit(manifest.settings))


def near_copies_sheet(groups: list[dict], read, max_pixels: int, rows: int = 6, per_row: int = 5) -> bytes | None:
    """previews/near-duplicates.jpg: the largest groups of near-copies, one row each, every photo with its split and
    its distance to the closest other; `read(path)` gives a source photo's bytes (None where it cannot)."""
    shown = sorted(groups, key=lambda g: (-len(g["photos"]), g["photos"][0]["path"]))[:rows]
    if not shown:
        return None
    label = 28
    sheet = Image.new("RGB", (GAP + per_row * (CELL + GAP), TITLE + len(shown) * (CELL + label + GAP)), (30, 30, 30))
    draw = ImageDraw.Draw(sheet)
    draw.text((8, 8), f"near-copies: the {len(shown)} largest of {len(groups)} groups (split, bits apart)",
              fill=(240, 240, 240))
    for r, g in enumerate(shown):
        y = TITLE + r * (CELL + label + GAP)
        for c, p in enumerate(g["photos"][:per_row]):
            x, data = GAP + c * (CELL + GAP), read(p["path"])
            with contextlib.suppress(OSError, ValueError, SyntaxError, Image.DecompressionBombError, TypeError):
                imageguard.check(data, max_pixels)
                tile = _tile(data)
                sheet.paste(tile, (x + (CELL - tile.width) // 2, y + (CELL - tile.height) // 2))
            colour = (255, 120, 90) if g["straddles"] and p["split"] == "val" else (220, 220, 220)
            draw.text((x, y + CELL + 2), f"{p['split']} · {p['distance']} bits", fill=colour)
            draw.text((x, y + CELL + 14), p["path"].rsplit("/", 1)[-1][:34], fill=(170, 170, 170))
    buf = io.BytesIO()
    sheet.save(buf, "JPEG", quality=85)
    return buf.getvalue()

"""`fastpipe inspect A --against B`: the photos of data set A that have a near-copy in data set B (a test set
against a training set, two versions of a set), from the fingerprints each conversion stored
(fingerprints.npz): nothing is decoded again. The picture shows each of A's photos beside its copy in B, read from
the conversions' source folders where they still are."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastpipe.dataset import nearcopy
from fastpipe.dataset.manifest import Manifest
from fastpipe.errors import ConfigError, DataError
from fastpipe.store.urls import check_relative
from fastpipe.util import atomic_write_bytes, read_regular

MAX_TABLE = 1 << 30  # a fingerprints.npz of about 2 million photos


def fingerprints(m: Manifest) -> tuple[list[str], list[str], np.ndarray]:
    """(splits, source paths, fingerprints) the conversion of `m` stored; a DataError naming the fix without."""
    name = (m.outputs.get("near_duplicates") or {}).get("fingerprints")
    if not name:
        raise DataError(f"{m.location} holds no fingerprints (converted before fastpipe fingerprinted photos, with "
                        f"--near-duplicates off, or by another tool): convert it again with fastpipe shard to "
                        f"compare it")
    try:
        return nearcopy.read_table(m.files.cat(name, MAX_TABLE))
    except (OSError, ValueError, KeyError) as e:  # DataError (missing, too large) is a ValueError
        raise DataError(f"{m.location}/{name}: not a fingerprint table fastpipe wrote ({e}); convert the data set "
                        f"again") from None


def against(a: Manifest, b: Manifest, threshold: int) -> list[dict]:
    """Each photo of A with its closest near-copy in B: {a_split, a_path, b_split, b_path, bits}, by A's path. A
    photo of A is looked for whole among B's photos and their crops (a copy of a B photo, resized, recompressed or
    cut from it); a B photo cut from a larger A photo is not looked for."""
    (sa, pa, fa), (sb, pb, fb) = fingerprints(a), fingerprints(b)
    best = nearcopy.nearest(fa, nearcopy.Index(fb), threshold)  # A's whole pictures against B's crops of theirs
    return sorted(({"a_split": sa[i], "a_path": pa[i], "b_split": sb[j], "b_path": pb[j], "bits": d}
                   for i, found in enumerate(best) if found for j, d in [found]), key=lambda r: r["a_path"])


def lines(rows: list[dict], a: Manifest, b: Manifest, photos: int, shown: int = 20) -> list[str]:
    if not rows:
        return [f"against {b.location}: none of the {photos} photos of {a.location} has a near-copy there"]
    out = [f"against {b.location}: {len(rows)} of the {photos} photos of {a.location} have a near-copy there "
           f"(a test set that overlaps training scores what training saw)"]
    out += [f"  {_shown(r['a_split'])}/{_shown(r['a_path'])}  ~  {_shown(r['b_split'])}/{_shown(r['b_path'])}  "
            f"({r['bits']} bits)" for r in rows[:shown]]
    return out + ([f"  ... and {len(rows) - shown} more"] if len(rows) > shown else [])


def _shown(text: str) -> str:
    """A path from a table anyone could have written, printable: control characters escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def picture(rows: list[dict], a: Manifest, b: Manifest, path: Path, shown: int = 8, cell: int = 200) -> bool:
    """Pairs side by side (A's photo, then B's), from the source folders the conversions recorded; False when no
    photo could be read there (the folders moved, or were in a store)."""
    roots = [Path(str(m.settings.get("source", ""))) for m in (a, b)]
    sheet = Image.new("RGB", (2 * cell + 30, 24 + min(len(rows), shown) * (cell + 24)), (30, 30, 30))
    draw, drawn = ImageDraw.Draw(sheet), 0
    draw.text((8, 6), f"{a.location} (left) ~ {b.location} (right)"[:80], fill=(240, 240, 240))
    for k, r in enumerate(rows[:shown]):
        y = 24 + k * (cell + 24)
        for c, (root, rel) in enumerate(zip(roots, (r["a_path"], r["b_path"]))):
            try:  # a path from a table anyone could have written: inside its source folder only
                im = Image.open(io.BytesIO(read_regular(root / check_relative(rel, "a fingerprint's path"), 256 << 20)))
                im.draft("RGB", (cell, cell))
                im = im.convert("RGB")
                im.thumbnail((cell, cell))
            except (OSError, ValueError, ConfigError, Image.DecompressionBombError):
                continue
            sheet.paste(im, (10 + c * (cell + 10), y))
            drawn += 1
        draw.text((10, y + cell + 4), f"{r['bits']} bits: {r['a_path'][-40:]}", fill=(200, 200, 200))
    if not drawn:
        return False
    buf = io.BytesIO()
    sheet.save(buf, "JPEG", quality=85)
    atomic_write_bytes(path, buf.getvalue())
    return True

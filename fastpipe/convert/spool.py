"""Photos converted while they are hashed, kept until they are written: with near-copy fingerprints on, the plan
needs every photo's fingerprint before the split, and taking it from a decode of its own cost a second entropy
decode of every photo (1.6x the conversion's CPU). So the hashing step converts each photo (images.process), takes
the fingerprint from the small stored JPEG, and keeps the result here, under OUT, named by the photo's sha256 and
the image settings; the converting step then writes it instead of decoding the photo again. A run stopped in
between keeps the spool for the rerun; a finished run removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

from fastpipe.convert import images
from fastpipe.errors import FastpipeError
from fastpipe.util import atomic_write_bytes, read_json, read_regular

FOLDER = ".fastpipe-spool"


def folder(out: Path, settings: images.ImageSettings, suffix: str = "") -> Path:
    """Where this part's photos converted with these settings are kept (other settings: another folder)."""
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:16]
    return out / FOLDER / f"{digest}{suffix}"


def put(where: Path, sha256: str, enc: images.Encoded) -> None:
    where.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(where / f"{sha256}.jpg", enc.jpeg)
    record = {"size": enc.size, "orig_size": enc.orig_size, "pixel_sum": enc.pixel_sum,
              "pixel_sumsq": enc.pixel_sumsq, "mode": enc.mode}
    atomic_write_bytes(where / f"{sha256}.json", json.dumps(record).encode())  # last: the entry is complete


def take(where: Path, sha256: str, limit: int) -> images.Encoded | None:
    """The photo converted while hashing, or None (not there, or not a record this module wrote)."""
    try:
        r = read_json(where / f"{sha256}.json")
        jpeg = read_regular(where / f"{sha256}.jpg", limit)
        pair = lambda v: tuple(int(x) for x in v) if len(v) == 2 else None  # noqa: E731
        sums = [tuple(float(x) for x in r[k]) for k in ("pixel_sum", "pixel_sumsq")]
        size, orig = pair(r["size"]), pair(r["orig_size"])
        if size is None or orig is None or any(len(s) != 3 for s in sums) or not isinstance(r["mode"], str):
            return None
    except (OSError, ValueError, KeyError, TypeError, FastpipeError):
        return None
    return images.Encoded(jpeg=jpeg, size=size, orig_size=orig, pixel_sum=sums[0], pixel_sumsq=sums[1],
                          mode=r["mode"])


def remove(where: Path) -> None:
    """This part's spool, and the spool folder once no part's is left."""
    shutil.rmtree(where, ignore_errors=True)
    with contextlib.suppress(OSError):  # another part's is still there
        where.parent.rmdir()

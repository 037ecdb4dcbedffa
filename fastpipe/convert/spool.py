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
import os
import shutil
import zlib
from pathlib import Path

from fastpipe.convert import images
from fastpipe.errors import FastpipeError
from fastpipe.util import read_regular

FOLDER = ".fastpipe-spool"
SUFFIX = ".entry"
HEADER_LIMIT = 4096  # an entry's JSON line, at most


def folder(out: Path, settings: images.ImageSettings, suffix: str = "") -> Path:
    """Where this part's photos converted with these settings are kept (other settings: another folder)."""
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:16]
    return out / FOLDER / f"{digest}{suffix}"


def put(where: Path, sha256: str, enc: images.Encoded) -> None:
    """One file an entry: a JSON line (the record, the JPEG's length and CRC-32), then the JPEG. Written under a
    temporary name and renamed, not synced: a spool is a cache, and an entry a crash left damaged fails take()'s
    check and is converted again."""
    where.mkdir(parents=True, exist_ok=True)
    record = {"size": enc.size, "orig_size": enc.orig_size, "pixel_sum": enc.pixel_sum,
              "pixel_sumsq": enc.pixel_sumsq, "mode": enc.mode, "length": len(enc.jpeg),
              "crc32": zlib.crc32(enc.jpeg)}
    path = where / f"{sha256}{SUFFIX}"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a crashed run's, or a link: removed, never written through
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(record).encode() + b"\n" + enc.jpeg)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def take(where: Path, sha256: str, limit: int) -> images.Encoded | None:
    """The photo converted while hashing, or None (not there, or not a whole entry this module wrote)."""
    try:
        data = read_regular(where / f"{sha256}{SUFFIX}", limit + HEADER_LIMIT)
        head, sep, jpeg = data.partition(b"\n")
        r = json.loads(head) if sep and len(head) <= HEADER_LIMIT else None
        pair = lambda v: tuple(int(x) for x in v) if len(v) == 2 else None  # noqa: E731
        sums = [tuple(float(x) for x in r[k]) for k in ("pixel_sum", "pixel_sumsq")]
        size, orig = pair(r["size"]), pair(r["orig_size"])
        if size is None or orig is None or any(len(s) != 3 for s in sums) or not isinstance(r["mode"], str) or \
                r["length"] != len(jpeg) or r["crc32"] != zlib.crc32(jpeg):
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

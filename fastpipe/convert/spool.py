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
import tempfile
import zlib
from pathlib import Path

from fastpipe.convert import images
from fastpipe.store import cachefiles
from fastpipe.util import parse_json, read_regular

FOLDER = ".fastpipe-spool"
SUFFIX = ".entry"
HEADER_LIMIT = 4096  # an entry's JSON line, at most


def folder(out: Path, settings: images.ImageSettings, suffix: str = "") -> Path:
    """Where this part's photos converted with these settings are kept (other settings: another folder)."""
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:16]
    return out / FOLDER / f"{digest}{suffix}"


def put(where: Path, sha256: str, enc: images.Encoded) -> None:
    """One file an entry: a JSON line (the record, the JPEG's length and CRC-32), then the JPEG. Written under a
    temporary name of its own (threads and processes may write the same photo at once) and renamed, not synced: a
    spool is a cache, and an entry a crash left damaged fails take()'s check and is converted again. The folder is
    this user's alone (cachefiles.private_folder): no one else can plant or swap an entry."""
    where = cachefiles.private_folder(where)
    record = {"size": enc.size, "orig_size": enc.orig_size, "pixel_sum": enc.pixel_sum,
              "pixel_sumsq": enc.pixel_sumsq, "mode": enc.mode, "length": len(enc.jpeg),
              "crc32": zlib.crc32(enc.jpeg)}
    fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{sha256}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(record).encode() + b"\n" + enc.jpeg)
        os.replace(tmp, where / f"{sha256}{SUFFIX}")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def take(where: Path, sha256: str, limit: int) -> images.Encoded | None:
    """The photo converted while hashing, or None: not there, not a whole entry this module wrote, or not a regular
    file of this user's (a link is never followed). Anything wrong with it means converting the photo again."""
    try:
        data = read_regular(cachefiles.private_folder(where) / f"{sha256}{SUFFIX}", limit + HEADER_LIMIT,
                            opener=cachefiles.open_own)
        head, sep, jpeg = data.partition(b"\n")
        r = parse_json(head) if sep and len(head) <= HEADER_LIMIT and len(jpeg) <= limit else None
        pair = lambda v: tuple(int(x) for x in v) if len(v) == 2 else None  # noqa: E731
        sums = [tuple(float(x) for x in r[k]) for k in ("pixel_sum", "pixel_sumsq")]
        size, orig = pair(r["size"]), pair(r["orig_size"])
        if size is None or orig is None or any(len(s) != 3 for s in sums) or not isinstance(r["mode"], str) or \
                r["length"] != len(jpeg) or r["crc32"] != zlib.crc32(jpeg):
            return None
    except Exception:  # missing, not ours, garbage (too deep, inf where an int goes): converted again
        return None
    return images.Encoded(jpeg=jpeg, size=size, orig_size=orig, pixel_sum=sums[0], pixel_sumsq=sums[1],
                          mode=r["mode"])


def remove(where: Path) -> None:
    """This part's spool, and the spool folder once no part's is left."""
    shutil.rmtree(where, ignore_errors=True)
    with contextlib.suppress(OSError):  # another part's is still there
        where.parent.rmdir()

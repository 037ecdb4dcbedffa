"""One photo's bytes, wherever the photo is, and the per-photo work of the converter's workers: hashing it (the
plan's duplicate check) and converting it (images.process).

A photo is named by its location: a path on this machine, or a URL inside SRC's folder in a store. Either way it is
read whole and at most --max-file-size bytes: a local file through util.read_regular (regular files only), an object
through store.remote.Remote (bounded, retried, cut off past the limit). What the photo itself is to blame for becomes a
`Rejected` (a reason of images.REASONS), a redirect of its URL to another origin included (`outside-root`: that
server's other rows may still be served where they were listed); what it is not (a store that keeps failing,
credentials it refuses) stops the conversion, naming the photo: a node without credentials would otherwise reject
every photo it was given.

The workers (local processes, or Ray tasks: onray.py) are set up once by `init_worker`, then `hash_one` and
`convert_one` take a location each. The plan is made from each photo's sha256 (duplicates, labels, the fingerprint):
the converter gives `convert_one` a `Planned` location, carrying that hash, and a photo whose bytes no longer have it
(replaced or edited since it was hashed) is a `changed` rejection, not converted as it now is: the same bytes could
otherwise be in train under one label and in val under another, or be an unseen duplicate.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import warnings
from pathlib import Path

from PIL import Image

from fastpipe.convert import images, spool
from fastpipe.errors import DataError
from fastpipe.store.clients import CrossOriginRedirect, ObjectTooLarge
from fastpipe.store.location import Folder
from fastpipe.store.remote import RemoteError
from fastpipe.util import FileTooLarge, NotRegularFile


class Planned(str):
    """A photo's location (the text itself: whatever names a photo, a dead worker's message or a Ray task's failure,
    takes it as one) with the sha256 the plan hashed it with."""

    def __new__(cls, where: str, sha256: str):
        self = super().__new__(cls, where)
        self.sha256 = sha256
        return self

    def __reduce__(self):  # to worker processes and Ray tasks, with the hash
        return Planned, (str(self), self.sha256)


def read(where: str, limit: int, files=None) -> bytes | images.Rejected:
    """The photo's bytes (at most `limit`), or why it cannot be converted. `files`: SRC's location (a store's or a
    folder's, store.location) that `where` is in; None for a photo file named on its own."""
    if files is None:
        files = Folder(os.path.dirname(where) or ".")
    try:
        return files.cat(files.relative(where), limit)
    except RemoteError as e:
        cause = e.__cause__
        if isinstance(cause, FileTooLarge):  # its size is known
            return images.Rejected("too-large", f"{cause}; raise --max-file-size to convert it")
        if isinstance(cause, ObjectTooLarge):
            return images.Rejected("too-large", f"{where}: more than the limit of {limit} bytes; raise "
                                                f"--max-file-size to convert it")
        if isinstance(cause, NotRegularFile):
            return images.Rejected("not-a-file", str(cause))
        if isinstance(cause, FileNotFoundError):
            return images.Rejected("missing", "no such file")
        if isinstance(cause, CrossOriginRedirect):  # the row's photo only: the server moved it, not the list
            return images.Rejected("outside-root", f"{cause.asked} redirects to {cause.target}, another origin "
                                                   f"(scheme, host, port): not read; list the photo where it is "
                                                   f"served from, inside the list's folder")
        if isinstance(cause, OSError) and files.folder is not None:  # permissions, I/O: this file, not the run
            return images.Rejected("unreadable", f"{type(cause).__name__}: {cause.strerror or cause}")
        raise


# -- the workers' side --------------------------------------------------------------------------------------
_STATE: tuple | None = None  # (settings, the file size limit, SRC's location)
_FINGERPRINTS = False  # hash_one also takes each photo's near-copy fingerprint
_SPOOL: Path | None = None  # ... converting the photo to take it, kept for convert_one (spool.py)


def init_worker(settings: images.ImageSettings, limit: int, files=None, fingerprints: bool = False,
                spool_at: str | None = None) -> None:
    """Set up this process for `hash_one` and `convert_one`. `files`: SRC's location; a folder must be there (a
    Ray node without the shared file system would otherwise find every photo unreadable). `spool_at`: where
    hash_one keeps the photos it converts (None: it decodes them for the fingerprint alone)."""
    global _STATE, _FINGERPRINTS, _SPOOL
    _FINGERPRINTS, _SPOOL = fingerprints, Path(spool_at) if spool_at else None
    if files is not None and files.folder is not None and not files.folder.is_dir():
        raise DataError(f"SRC {files.folder} is not a folder on {socket.gethostname()}: with --ray, a local SRC must "
                        f"be at the same path on every node (a shared file system); or put the photos in a store "
                        f"(s3://, gs://, az://) and give its URL as SRC")
    _STATE = (settings, limit, files)


def convert_one(where: str) -> images.Encoded | images.Rejected:
    """The photo converted, or why not; a `Planned` one only if its bytes are still those the plan hashed."""
    settings, limit, remote = _STATE
    data = read(where, limit, remote)
    if isinstance(data, images.Rejected):
        return data
    planned = getattr(where, "sha256", None)
    if planned is not None and (now := hashlib.sha256(data).hexdigest()) != planned:
        return images.Rejected("changed", f"its bytes changed after they were hashed for the plan (sha256 "
                                          f"{planned[:12]}... then, {now[:12]}... now), so it was not converted; run "
                                          f"the command again with --overwrite to convert the photos as they are now")
    kept = spool.take(_SPOOL, planned, limit) if _SPOOL is not None and planned is not None else None
    return kept or images.process(data, settings)


def hash_one(where: str) -> tuple | images.Rejected:
    """(sha256, size in bytes, pixels as the header says: 0 when it says nothing, the near-copy fingerprint or None)
    or why the file cannot be used. The pixels size what a Ray task reserves in memory to convert the photo (its
    header, not its data: ~0.1 ms); the fingerprint is taken from the photo converted (spool.py)."""
    settings, limit, remote = _STATE
    data = read(where, limit, remote)
    if isinstance(data, images.Rejected):
        return data
    sha = hashlib.sha256(data).hexdigest()
    fp = None
    if _FINGERPRINTS:  # the fingerprint of the photo as stored, wherever it is taken (the same plan everywhere)
        enc = spool.take(_SPOOL, sha, limit) if _SPOOL is not None else None  # a stopped run's, resumed
        if enc is None:
            enc = images.process(data, settings)
            if isinstance(enc, images.Encoded) and _SPOOL is not None:  # kept: converting it will not decode it again
                spool.put(_SPOOL, sha, enc)
        if isinstance(enc, images.Encoded):
            fp = images.fingerprint(enc.jpeg, settings)
    return sha, len(data), _pixels(data), fp


def _pixels(data: bytes) -> int:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w, h = Image.open(io.BytesIO(data)).size
    except Exception:  # not an image, or one Pillow refuses: converting it will say which
        return 0
    return w * h

"""Which .pt2 files this user's `fastpipe export` wrote, so that `predict` loads those and no other without being
told to (pt2.py says why a .pt2 is code): the sha256 of each, a line each, in a folder private to the user
($FASTPIPE_HOME, else $XDG_DATA_HOME/fastpipe or ~/.local/share/fastpipe; 0700, checked as the shard cache's is)."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from fastpipe.errors import FastpipeError, FastpipeWarning
from fastpipe.store.cachefiles import private_folder
from fastpipe.util import read_regular

NAME = "exported-pt2.sha256"
LIMIT = 64 << 20  # bytes: a million exports


def _file() -> Path:
    home = os.environ.get("FASTPIPE_HOME")
    base = Path(home) if home else Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / \
        "fastpipe"
    return private_folder(base) / NAME


def remember(sha256: str) -> None:
    """Record an export this user just wrote; where that cannot be done, say what predict will then need."""
    try:
        fd = os.open(_file(), os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(sha256 + "\n")
    except (OSError, FastpipeError) as e:
        warnings.warn(f"the export could not be recorded as this user's ({e}): `fastpipe predict` will need "
                      f"--trust-pt2 to load it", FastpipeWarning, stacklevel=3)


def known(sha256: str) -> bool:
    """Whether this user's `fastpipe export` wrote a file of this sha256."""
    try:
        lines = read_regular(_file(), LIMIT).decode("ascii", "replace").split()
    except (OSError, FastpipeError):
        return False
    return bool(re.fullmatch(r"[0-9a-f]{64}", sha256)) and sha256 in lines

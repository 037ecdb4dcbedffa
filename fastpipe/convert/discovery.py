"""Which kind of SRC this is, and the module that discovers its photos: a folder tree (sources.py), a list of
`path,label` rows (lists.py), or either of them in a store (listing.py)."""

from __future__ import annotations

import os
from pathlib import Path

from fastpipe.convert.listing import from_store
from fastpipe.convert.lists import LIST_SUFFIXES, from_list
from fastpipe.convert.sources import MAX_ROWS, Source, check_rows, from_folder
from fastpipe.errors import ConfigError
from fastpipe.store.location import open_location


def discover(src: str | os.PathLike, exclude=None, limit: int = 1 << 30, max_rows: int = MAX_ROWS,
             unlabelled: bool = False) -> Source:
    """The items of SRC; `exclude` (the output folder or URL, when it lies inside SRC) is never entered. `limit`
    (--max-file-size): objects in a store known from their listing to be larger are refused without being read.
    `max_rows` (--max-rows): a longer list is refused before its rows are read."""
    where = open_location(src, what="SRC")
    if where.folder is None:  # a store's folder or list: its listing (listing.py)
        return from_store(where.url, exclude, limit, max_rows, unlabelled)
    src = where.folder
    if src.is_dir():
        return from_folder(src, exclude if isinstance(exclude, Path) else None)  # a URL is never in a folder
    if src.is_file() and src.suffix.lower() in LIST_SUFFIXES:
        with open(src, "rb") as f:  # counted a MiB at a time: a list of any size is never read whole to be refused
            check_rows(iter(lambda: f.read(1 << 20), b""), str(src), max_rows)
        return from_list(src, unlabelled)
    if not src.exists():
        raise ConfigError(f"{src} does not exist")
    raise ConfigError(f"{src}: expected a folder of class folders or a list file "
                      f"({', '.join(sorted(LIST_SUFFIXES))})")

"""SRC in object storage (s3://raw/photos, gs://, az://; an http(s) list): what discovery finds there.

A folder URL is listed, once (never a request per photo), and its names are read as `sources.from_folder` reads a
tree: class folders, or SRC/train + SRC/val; hidden and system names ignored; a file outside a class folder
refused. A list URL (ending in .csv, .txt, ...) is fetched and read as a list on disk is (lists.py), each row's path
relative to the list's folder, or a URL inside that folder. Every name is held to the URL policy
(urls.check_relative): what is checked is exactly what the store is asked for; a key with a '.' or '..' segment
(photos/cat/../x.jpg), which a store keeps as written, is a `bad-name` rejection, not a hidden name. An object over
--max-file-size is refused from the listing's size, without being read. An http(s) server has no listing: there, SRC
must be a list.

The photos themselves are read later, by whichever process converts them (photos.py), through store.remote.Remote.
"""

from __future__ import annotations

from fastpipe.convert.lists import LIST_SUFFIXES, from_bytes
from fastpipe.convert.sources import MAX_ROWS, Item, Rejection, Source, check_rows, class_order, is_hidden, numeric_note
from fastpipe.errors import ConfigError, DataError
from fastpipe.store.remote import Remote
from fastpipe.store.urls import check_relative, redact

BAD_NAME = ("the object's name holds what a URL would decode or normalise (%, ?, #, \\, a control character, an "
            "empty, '.' or '..' segment): rename it")


def from_store(url: str, exclude=None, limit: int = 1 << 30, max_rows: int = MAX_ROWS,
               unlabelled: bool = False) -> Source:
    """The Source of a folder or a list (of at most `max_rows` rows) in a store. `exclude`: OUT, when it is a folder
    inside SRC's."""
    url = url.rstrip("/")
    name = url.rsplit("/", 1)[-1]
    if "." in name and "." + name.rsplit(".", 1)[-1].lower() in LIST_SUFFIXES:
        return _list(url, max_rows, unlabelled)
    remote = Remote(url)
    if remote.protocol in ("http", "https"):
        raise ConfigError(f"SRC {url}: an http(s) server cannot be listed, so its photos cannot be discovered; give "
                          f"a list instead ({url}/photos.csv: one 'path,label' row per photo, paths relative to the "
                          f"list's folder)")
    out = str(exclude or "").rstrip("/")  # a local OUT never starts with the URL
    skip = out[len(url) + 1:] if out.startswith(url + "/") else None
    found = [(rel, size) for rel, size in remote.listing()
             if not skip or (rel != skip and not rel.startswith(skip + "/"))]
    items, rejections, ignored = _classify(found, limit)
    if not items:
        raise DataError(f"{url}: no image files found in class folders. Expected SRC/<class>/<image files> (or "
                        f"SRC/train/<class>/..., SRC/val/<class>/...), or a CSV list of path,label rows")
    classes = class_order(i.label for i in items)
    return Source(url, tuple(items), tuple(rejections), classes, ignored, numeric_note(classes), files=remote)


def _classify(found: list[tuple[str, int]], limit: int) -> tuple[list[Item], list[Rejection], int]:
    """Items, rejections and the count of hidden entries, as the walk of the same tree on disk gives them."""
    hidden: set[tuple[str, ...]] = set()
    visible = []
    for rel, size in found:
        segs = rel.split("/")
        # '.' and '..' are not hidden names: a store keeps them literally, and no folder on disk can hold them
        first = next((k for k, s in enumerate(segs) if is_hidden(s) and s not in (".", "..")), None)
        if first is not None:  # a hidden folder counts once, as on disk, whatever it holds
            hidden.add(tuple(segs[: first + 1]))
        else:
            visible.append((rel, segs, size))
    fixed = {"train", "val"} <= {segs[0] for _, segs, _ in visible if len(segs) > 1}
    items, rejections = [], []
    for rel, segs, size in visible:
        if not _plain(rel):
            rejections.append(Rejection(rel, "bad-name", BAD_NAME))
        elif fixed and segs[0] not in ("train", "val"):
            rejections.append(Rejection(rel, "other-split", "only SRC/train and SRC/val are converted when both "
                                                            "exist"))
        elif len(segs) < (3 if fixed else 2):
            rejections.append(Rejection(rel, "no-class", "not inside a class folder (SRC/<class>/...)"))
        elif size > limit:
            rejections.append(Rejection(rel, "too-large", f"{rel}: {size} bytes, more than the limit of {limit}; "
                                                          f"raise --max-file-size to convert it"))
        else:
            items.append(Item(rel, segs[1], segs[0]) if fixed else Item(rel, segs[0], None))
    return items, rejections, len(hidden)


def _plain(rel: str) -> bool:
    try:
        check_relative(rel, "a name")
    except ConfigError:
        return False
    return True


def _list(url: str, max_rows: int, unlabelled: bool = False) -> Source:
    """A list in a store: fetched whole (at most 64 MiB), its rows counted, then read as lists.py reads them. Whether
    each row's object exists is found when it is read (a missing one is rejected then): a store is not asked once
    per row here."""
    folder, name = url.rsplit("/", 1)
    remote = Remote(folder)
    data = remote.cat(name)
    check_rows([data], url, max_rows)
    return from_bytes(data, url, folder, lambda raw: _place(folder, raw), files=remote, unlabelled=unlabelled)


def _place(folder: str, raw: str) -> str | Rejection:
    """A row's path in a list in a store: a plain relative path, or a URL inside the list's folder."""
    rel = raw[len(folder) + 1:] if raw.startswith(folder + "/") else raw
    if not _plain(rel):  # another URL has an empty segment ('//'): not plain
        return Rejection(redact(raw), "outside-root", f"not a plain path inside the list's folder {folder} (no "
                                                      f"other URL, '..', %-escape, ? or #)")
    return rel


__all__ = ["from_store"]

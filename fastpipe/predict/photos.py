"""The photos `fastpipe predict` is given, found and read by the converter's rules, and each one prepared exactly
as the converter prepared the training photos.

SRC is what `fastpipe shard` takes: a folder (its class folders give each photo a label when their names are the
model's classes; otherwise every photo in the tree is predicted without one), a `path[,label]` list, photo files,
or a store URL. Files that cannot be used are rejections with the converter's reasons, each a line of the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastpipe.convert import images, photos
from fastpipe.convert.discovery import discover
from fastpipe.convert.lists import LIST_SUFFIXES
from fastpipe.convert.sources import Rejection, Source, display, files_below, is_hidden
from fastpipe.errors import ConfigError, DataError
from fastpipe.store.location import open_location
from fastpipe.store.urls import check_relative


@dataclass(frozen=True)
class Photo:
    where: str  # what is read: a path on this machine, or a URL
    name: str  # as the output shows it: relative to SRC, or as given
    label: str | None  # the class name (a label set: names joined by ';') SRC gives it, None for none


@dataclass(frozen=True)
class Photos:
    items: tuple[Photo, ...]
    rejections: tuple[Rejection, ...]
    files: object = None  # what reads them (store.location): SRC's folder or store folder; None: files named alone
    notes: tuple[str, ...] = ()
    ignored: int = 0


def find(src: list[str], classes: list[str], multilabel: bool, limit: int) -> Photos:
    """The photos of SRC (one folder, list or store URL; or photo files), labelled where SRC says."""
    if len(src) == 1 and _is_collection(src[0]):
        return _collection(src[0], classes, multilabel, limit)
    items, rejections = [], []
    for s in src:
        if open_location(s, what="SRC").folder is None:
            raise ConfigError(f"SRC {s}: give a folder or a list in a store as the only SRC (photo files are read "
                              f"from this machine)")
        if Path(s).is_dir():
            raise ConfigError(f"SRC {s} is a folder: give it alone (predict takes one folder, one list, or files)")
        items.append(Photo(s, display(s), None))
    return Photos(tuple(items), tuple(rejections))


def _is_collection(s: str) -> bool:
    folder = open_location(s, what="SRC").folder
    return folder is None or folder.is_dir() or folder.suffix.lower() in LIST_SUFFIXES


def _collection(src: str, classes: list[str], multilabel: bool, limit: int) -> Photos:
    where = open_location(src, what="SRC")
    listed = where.folder is None and "." + src.rstrip("/").rsplit(".", 1)[-1].lower() in LIST_SUFFIXES
    if where.folder is not None and not where.folder.exists():
        raise ConfigError(f"SRC {src} does not exist")
    try:
        source = discover(src, limit=limit, unlabelled=True)
    except DataError:  # no class folders: photos without labels, unless it is a list (its error says why)
        if listed or Path(src).is_file():
            raise
        source = None
    if source is not None and (listed or Path(str(src)).is_file()):
        return _labelled(source, note=None)
    if source is not None and not multilabel and set(source.classes) <= set(classes):
        return _labelled(source, note=f"labels from the class folders of {src}")
    note = (f"the folders of {src} are not the model's classes ({', '.join(classes[:5])}...): predicting without "
            f"labels") if source is not None else None
    return _unlabelled_store(where, limit, note) if where.folder is None else _unlabelled_folder(where, note)


def _labelled(source: Source, note: str | None) -> Photos:
    """A source's items with their labels; its photos outside a class folder are predicted without one."""
    # a label set may be empty ("none of them"), a label of its own; a list of paths alone gives none
    items = [Photo(source.files.join(i.path), i.path, i.label if source.multilabel else i.label or None)
             for i in source.items]
    unlabelled = [r for r in source.rejections if r.reason == "no-class"]
    items += [Photo(source.files.join(r.path), r.path, None) for r in unlabelled]
    rejections = tuple(r for r in source.rejections if r.reason != "no-class")
    return Photos(tuple(items), rejections, source.files, (note,) * bool(note) + source.notes, source.ignored)


def _unlabelled_folder(where, note: str | None) -> Photos:
    root = where.folder
    files, rejections, ignored = files_below(root)
    items = [Photo(str(root / rel), rel, None) for rel in files]
    if not items:
        raise DataError(f"{root}: no files found to predict (hidden and system files are ignored)")
    return Photos(tuple(items), tuple(rejections), where, (note,) * bool(note), ignored)


def _unlabelled_store(remote, limit: int, note: str | None) -> Photos:
    url = remote.url
    items, rejections, ignored = [], [], 0
    for rel, size in remote.listing():
        if any(is_hidden(s) for s in rel.split("/")):
            ignored += 1
        elif not _plain(rel):
            rejections.append(Rejection(rel, "bad-name", "the object's name holds what a URL would decode or "
                                                         "normalise: rename it"))
        elif size > limit:
            rejections.append(Rejection(rel, "too-large", f"{size} bytes, more than the limit of {limit}"))
        else:
            items.append(Photo(f"{url}/{rel}", rel, None))
    if not items:
        raise DataError(f"{url}: no files found to predict")
    return Photos(tuple(items), tuple(rejections), remote, (note,) * bool(note), ignored)


def _plain(rel: str) -> bool:
    try:
        check_relative(rel, "a name")
    except ConfigError:
        return False
    return True


# -- preparing one photo (in a worker process, or in this one) -----------------------------------------------
_STATE: tuple | None = None  # (settings, the file size limit, SRC's location)


def init_worker(settings: images.ImageSettings | None, limit: int, files=None) -> None:
    global _STATE
    _STATE = (settings, limit, files)


def prepare_one(where: str) -> bytes | images.Rejected:
    """The photo as a shard would store it (worker side): read at most the file size limit, then `prepare`."""
    settings, limit, files = _STATE
    data = photos.read(where, limit, files)
    return data if isinstance(data, images.Rejected) else prepare(data, settings)


def prepare(data: bytes, settings: images.ImageSettings | None) -> bytes | images.Rejected:
    """The converter's image step: the bytes of the clean RGB JPEG a shard would hold (EXIF rotation, RGB on white,
    downsampled with the converter's filter, re-encoded at its quality), or why the photo cannot be used. With
    `settings` None (a model trained on shards another tool wrote) the photo is used as it is, once it opens
    within the default pixel limit."""
    if settings is None:
        opened = images._open_checked(data, images.ImageSettings())
        return opened if isinstance(opened, images.Rejected) else data
    done = images.process(data, settings)
    return done.jpeg if isinstance(done, images.Encoded) else done


def settings_of(card: dict) -> images.ImageSettings | None:
    c = card.get("convert")
    return None if c is None else images.ImageSettings(c["short_side"], c["quality"], c["max_pixels"],
                                                       c["draft_gap"])


def workers_for(count: int | None) -> int:
    from fastpipe.util import usable_cores

    return usable_cores() if count is None else count


__all__ = ["Photo", "Photos", "find", "init_worker", "prepare", "prepare_one", "settings_of"]

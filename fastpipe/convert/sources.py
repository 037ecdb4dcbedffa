"""What discovery finds (`Source`: items and rejections), and an ImageFolder tree on this machine's disk.

The result is a list of `Item`s (files to read) and a list of `Rejection`s (files or rows refused before reading),
both with paths relative to SRC so that rejected.jsonl is readable on another machine. Nothing found is dropped
silently: a file is an item, a rejection, or counted as ignored (hidden and system files only). Lists of
`path,label` rows: lists.py; SRC in a store: listing.py; which one SRC is: discovery.py.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from fastpipe.errors import DataError
from fastpipe.store.location import Folder
from fastpipe.store.urls import redact

# Files and folders every photo collection carries that are not photos: ignored, and counted in the summary.
MAX_ROWS = 1_000_000  # rows a list may have unless --max-rows says more: each is a photo read, from a store a request
SYSTEM_NAMES = {"thumbs.db", "desktop.ini", "icon\r", "__macosx", "__pycache__", "$recycle.bin"}


@dataclass(frozen=True)
class Item:
    path: str  # relative to the source root, '/'-separated
    label: str  # class name
    split: str | None  # "train"/"val" when the source fixes it, else None


@dataclass(frozen=True)
class Rejection:
    """A file or row refused, as rejected.jsonl records it: its path and detail redacted (urls.redact), since both
    may quote a row of a list, a URL with its credentials or a pre-signed query."""

    path: str
    reason: str
    detail: str

    def __post_init__(self):
        object.__setattr__(self, "path", redact(self.path))
        object.__setattr__(self, "detail", redact(self.detail))

    def to_dict(self) -> dict:
        return {"path": self.path, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class Source:
    root: Path | str  # what relative paths are relative to: a folder, or a store's folder URL
    items: tuple[Item, ...]
    rejections: tuple[Rejection, ...]
    classes: tuple[str, ...]
    ignored: int = 0  # hidden and system files
    notes: tuple[str, ...] = ()  # what the summary should tell (header row, numeric labels, ...)
    multilabel: bool = False  # items' labels are label sets, "a;b" (sorted names joined by ';', "" for none)
    files: object = None  # what reads the items (store.location): SRC's folder, or its folder in a store

    def __post_init__(self):
        if self.files is None:
            object.__setattr__(self, "files", Folder(self.root))


def check_rows(chunks, where: str, limit: int) -> None:
    """Refuse a list of more than `limit` rows, counted (as lines) while its bytes are read, before any row is parsed:
    a list of 3 million rows made as many requests, and its parsed rows held gigabytes."""
    rows = 0
    for chunk in chunks:
        rows += max(chunk.count(b"\n"), chunk.count(b"\r"))  # line ends of any kind: \n, \r\n or \r
        if rows > limit:
            raise DataError(f"{where}: more than {limit:,} rows, the limit for a list (each is a photo to read; from a "
                            f"store, a request): raise --max-rows to convert a longer list")


def is_hidden(name: str) -> bool:
    return name.startswith(".") or name.lower() in SYSTEM_NAMES


def display(path: Path | str) -> str:
    """A path as text that can always be printed and written as UTF-8 (undecodable bytes shown as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Walk:
    """Every file below a folder in a stable order, following folder links but never into a loop (each real folder
    is entered once), and only regular files: a FIFO, a device or a socket is a rejection, not a hang."""

    def __init__(self, root: Path, exclude: Path | None):
        self.root = root
        self.files: list[Path] = []
        self.rejections: list[Rejection] = []
        self.ignored = 0
        st = root.stat()
        self._seen: set[tuple[int, int]] = {(st.st_dev, st.st_ino)}
        # OUT inside SRC: our own output is never input (compared by identity, whatever the spelling or links).
        self._exclude = _identity(exclude)

    def rel(self, p: Path) -> str:
        return display(p.relative_to(self.root).as_posix())

    def folder(self, d: Path) -> None:
        ident = _identity(d)
        if ident == self._exclude:
            return
        if ident in self._seen:
            self.rejections.append(Rejection(self.rel(d), "symlink-loop", "a link to a folder that is already "
                                             "converted (a loop, or a second link to it): not followed"))
            return
        self._seen.add(ident)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            self.rejections.append(Rejection(self.rel(d), "unreadable", f"{type(e).__name__}: {e.strerror or e}"))
            return
        for e in entries:
            self.entry(d / e.name, e.name)

    def entry(self, p: Path, name: str) -> None:
        if is_hidden(name):
            self.ignored += 1
            return
        if not _utf8(name):
            self.rejections.append(Rejection(self.rel(p), "bad-name", "the name is not valid UTF-8: rename it"))
            return
        try:
            st = p.stat()
        except OSError as e:
            self.rejections.append(Rejection(self.rel(p), "unreadable", f"{type(e).__name__}: {e.strerror or e}"))
            return
        if stat.S_ISDIR(st.st_mode):
            self.folder(p)
        elif stat.S_ISREG(st.st_mode):
            self.files.append(p)
        else:
            self.rejections.append(Rejection(self.rel(p), "not-a-file", "a named pipe, device or socket"))


def _identity(p: Path | None) -> tuple[int, int] | None:
    try:
        st = p.stat() if p is not None else None
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st else None


def class_order(labels) -> tuple[str, ...]:
    """Class names in label order: numeric order when every label is an integer (so '2' stays class 2 before
    '10'), else sorted as text (torchvision's ImageFolder order)."""
    labels = set(labels)
    if labels and all(x.isdigit() for x in labels):
        return tuple(sorted(labels, key=lambda x: (int(x), x)))
    return tuple(sorted(labels))


def numeric_note(classes: tuple[str, ...]) -> tuple[str, ...]:
    if classes and all(c.isdigit() for c in classes) and [int(c) for c in classes] != list(range(len(classes))):
        return (f"integer labels {classes[0]}..{classes[-1]} are not 0..{len(classes) - 1}: class index i is the "
                f"i-th label in numeric order (dataset.json 'classes' lists them)",)
    return ()


def from_folder(root: Path, exclude: Path | None = None) -> Source:
    """ImageFolder: SRC/<class>/**/file, or SRC/{train,val}/<class>/**/file for a fixed split."""
    walk = _Walk(root, exclude)
    top = sorted(os.scandir(root), key=lambda e: e.name)
    names = {e.name for e in top if e.is_dir() and not is_hidden(e.name)}
    fixed = {"train", "val"} <= names
    items: list[Item] = []
    for e in top:
        p = root / e.name
        if e.is_dir() and fixed and e.name in ("train", "val"):
            for c in sorted(os.scandir(p), key=lambda x: x.name):
                items += _class_items(walk, p / c.name, c.name, e.name, root)
        elif e.is_dir() and not fixed:
            items += _class_items(walk, p, e.name, None, root)
        else:
            reason, why = ("other-split", "only SRC/train and SRC/val are converted when both exist") if fixed \
                else ("no-class", "not inside a class folder (SRC/<class>/...)")
            items += _class_items(walk, p, None, None, root, (reason, why))
    if not items:
        raise DataError(f"{root}: no image files found in class folders. Expected SRC/<class>/<image files> (or "
                        f"SRC/train/<class>/..., SRC/val/<class>/...), or a CSV list of path,label rows")
    classes = class_order(i.label for i in items)
    return Source(root, tuple(items), tuple(walk.rejections), classes, walk.ignored, numeric_note(classes))


def _class_items(walk: _Walk, path: Path, label: str | None, split: str | None, root: Path,
                 refuse: tuple[str, str] | None = None) -> list[Item]:
    """The files under one class folder (or, with `refuse`, files that belong to no class: rejections)."""
    before = len(walk.files)
    if label is not None and not is_hidden(label) and not path.is_dir():
        refuse = ("no-class", "not inside a class folder (SRC/<class>/...)")
    walk.entry(path, path.name)
    found = walk.files[before:]
    del walk.files[before:]
    if refuse or label is None:
        walk.rejections += [Rejection(walk.rel(p), *refuse) for p in found]
        return []
    return [Item(p.relative_to(root).as_posix(), label, split) for p in found]


def files_below(root: Path) -> tuple[list[str], list[Rejection], int]:
    """Every file below `root` whatever the folders are (paths relative to it), by the walk's rules: the
    rejections it makes, and the count of hidden and system files ignored."""
    walk = _Walk(root, None)  # root itself counts as entered: its entries are walked here
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        walk.entry(root / e.name, e.name)
    return [walk.rel(p) for p in walk.files], walk.rejections, walk.ignored


def original_first(path: str) -> tuple:
    """Which of equal files is the original: the shortest file name ('x.jpg' before 'x (1).jpg' and
    'copy_of_x.jpg'), then the first in natural order ('img_9' before 'img_10'); the path itself last, so that
    every machine and every part of a cluster job keeps the same one."""
    parts = re.split(r"(\d+)", path)  # text, number, text, ...: each position compares like with like
    natural = tuple(int(p) if k % 2 else p.casefold() for k, p in enumerate(parts))
    return len(path.rsplit("/", 1)[-1]), natural, path

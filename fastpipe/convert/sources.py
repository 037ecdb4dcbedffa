"""Find the files to convert: an ImageFolder tree or a CSV/TXT list of `path,label` rows.

The result is a list of `Item`s (files to read) and a list of `Rejection`s (rows or paths refused before
reading), both with paths relative to SRC so that rejected.jsonl is readable on another machine.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

# Files every photo collection carries that are not photos; skipped without a record.
SYSTEM_FILES = {"thumbs.db", "desktop.ini", "icon\r"}
LIST_SUFFIXES = {".csv", ".txt", ".tsv", ".lst"}
HEADER_LABELS = {"label", "labels", "class", "category", "target", "y"}


@dataclass(frozen=True)
class Item:
    path: str  # relative to the source root, '/'-separated
    label: str  # class name
    split: str | None  # "train"/"val" when the source fixes it, else None


@dataclass(frozen=True)
class Rejection:
    path: str
    reason: str
    detail: str

    def to_dict(self) -> dict:
        return {"path": self.path, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class Source:
    root: Path  # what relative paths are relative to
    items: tuple[Item, ...]
    rejections: tuple[Rejection, ...]
    classes: tuple[str, ...]


def _is_hidden(name: str) -> bool:
    return name.startswith(".") or name.startswith("__") or name.lower() in SYSTEM_FILES


def _walk(folder: Path) -> list[Path]:
    """Every non-hidden file below folder, in a stable order (hidden folders are not entered)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not _is_hidden(d))
        found.extend(Path(dirpath) / f for f in sorted(filenames) if not _is_hidden(f))
    return found


def _class_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not _is_hidden(p.name))


def from_folder(root: Path) -> Source:
    """ImageFolder: SRC/<class>/**/file, or SRC/{train,val}/<class>/**/file for a fixed split."""
    subdirs = {p.name for p in _class_dirs(root)}
    fixed_split = {"train", "val"} <= subdirs
    items: list[Item] = []
    for split in ("train", "val") if fixed_split else (None,):
        base = root / split if split else root
        for class_dir in _class_dirs(base):
            items += [Item(p.relative_to(root).as_posix(), class_dir.name, split) for p in _walk(class_dir)]
    if not items:
        raise ValueError(f"{root}: no files found in class folders. Expected SRC/<class>/<image files> "
                         f"(or SRC/train/<class>/..., SRC/val/<class>/...), or a CSV list of path,label rows")
    classes = sorted({i.label for i in items})
    return Source(root, tuple(items), (), tuple(classes))


def _read_rows(path: Path) -> list[list[str]]:
    text = path.read_text(encoding="utf-8-sig")
    sample = text[:4096]
    try:
        dialect = csv.Sniffer().sniff(sample, delimiters=",\t;")
    except csv.Error:
        dialect = csv.excel
    rows = [r for r in csv.reader(text.splitlines(), dialect) if any(c.strip() for c in r)]
    if rows and len(rows[0]) > 1 and rows[0][1].strip().lower() in HEADER_LABELS:
        rows = rows[1:]
    return rows


def _check_row(root: Path, row: list[str], lineno: int) -> Item | Rejection:
    if len(row) < 2 or not row[0].strip() or not row[1].strip():
        return Rejection(f"<line {lineno}>", "bad-row", f"expected 'path,label', got {row!r}")
    raw, label = row[0].strip(), row[1].strip()
    full = Path(raw) if os.path.isabs(raw) else root / raw
    try:
        rel = full.resolve().relative_to(root.resolve())
    except ValueError:
        return Rejection(raw, "outside-root", f"resolves outside the list's folder {root}")
    if not full.is_file():
        return Rejection(rel.as_posix(), "missing", "no such file")
    return Item(rel.as_posix(), label, None)


def from_list(list_file: Path) -> Source:
    """A CSV/TXT of path,label rows (header optional); paths relative to the list's own folder."""
    root = list_file.parent
    items, rejections = [], []
    for lineno, row in enumerate(_read_rows(list_file), start=1):
        checked = _check_row(root, row, lineno)
        (items if isinstance(checked, Item) else rejections).append(checked)
    if not items:
        raise ValueError(f"{list_file}: no usable 'path,label' rows ({len(rejections)} rejected)")
    return Source(root, tuple(items), tuple(rejections), tuple(sorted({i.label for i in items})))


def discover(src: str | os.PathLike) -> Source:
    src = Path(src)
    if src.is_dir():
        return from_folder(src)
    if src.is_file() and src.suffix.lower() in LIST_SUFFIXES:
        return from_list(src)
    if not src.exists():
        raise ValueError(f"{src} does not exist")
    raise ValueError(f"{src}: expected a folder of class folders or a list file ({', '.join(sorted(LIST_SUFFIXES))})")

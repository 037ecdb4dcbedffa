"""Find the files to convert: an ImageFolder tree or a CSV/TXT list of `path,label` rows.

The result is a list of `Item`s (files to read) and a list of `Rejection`s (files or rows refused before reading),
both with paths relative to SRC so that rejected.jsonl is readable on another machine. Nothing found is dropped
silently: a file is an item, a rejection, or counted as ignored (hidden and system files only).
"""

from __future__ import annotations

import csv
import io
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from fastpipe.errors import ConfigError, DataError

# Files and folders every photo collection carries that are not photos: ignored, and counted in the summary.
SYSTEM_NAMES = {"thumbs.db", "desktop.ini", "icon\r", "__macosx", "__pycache__", "$recycle.bin"}
LIST_SUFFIXES = {".csv", ".txt", ".tsv", ".lst"}
HEADER_WORDS = {"label", "labels", "class", "classes", "category", "target", "y", "class_id", "classid",
                "class_name", "label_id", "path", "file", "filename", "file_name", "image", "img", "image_path",
                "filepath", "id", "name"}


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
    ignored: int = 0  # hidden and system files
    notes: tuple[str, ...] = ()  # what the summary should tell (header row, numeric labels, ...)
    multilabel: bool = False  # items' labels are label sets, "a;b" (sorted names joined by ';', "" for none)


def _is_hidden(name: str) -> bool:
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
        if _is_hidden(name):
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


def _numeric_note(classes: tuple[str, ...]) -> tuple[str, ...]:
    if classes and all(c.isdigit() for c in classes) and [int(c) for c in classes] != list(range(len(classes))):
        return (f"integer labels {classes[0]}..{classes[-1]} are not 0..{len(classes) - 1}: class index i is the "
                f"i-th label in numeric order (dataset.json 'classes' lists them)",)
    return ()


def from_folder(root: Path, exclude: Path | None = None) -> Source:
    """ImageFolder: SRC/<class>/**/file, or SRC/{train,val}/<class>/**/file for a fixed split."""
    walk = _Walk(root, exclude)
    top = sorted(os.scandir(root), key=lambda e: e.name)
    names = {e.name for e in top if e.is_dir() and not _is_hidden(e.name)}
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
    return Source(root, tuple(items), tuple(walk.rejections), classes, walk.ignored, _numeric_note(classes))


def _class_items(walk: _Walk, path: Path, label: str | None, split: str | None, root: Path,
                 refuse: tuple[str, str] | None = None) -> list[Item]:
    """The files under one class folder (or, with `refuse`, files that belong to no class: rejections)."""
    before = len(walk.files)
    if label is not None and not _is_hidden(label) and not path.is_dir():
        refuse = ("no-class", "not inside a class folder (SRC/<class>/...)")
    walk.entry(path, path.name)
    found = walk.files[before:]
    del walk.files[before:]
    if refuse or label is None:
        walk.rejections += [Rejection(walk.rel(p), *refuse) for p in found]
        return []
    return [Item(p.relative_to(root).as_posix(), label, split) for p in found]


def _is_header(row: list[str], root: Path) -> bool:
    """The first row is a header when it names no file and reads like column names: a known word in either
    column, or a first cell with no folder separator and no file extension."""
    if len(row) < 2:
        return False
    first, second = row[0].strip(), row[1].strip()
    if (root / first).is_file():
        return False
    words = {first.lower(), second.lower()}
    return bool(words & HEADER_WORDS) or ("/" not in first and "\\" not in first and "." not in first)


def _read_rows(path: Path) -> tuple[list[tuple[int, list[str]]], list[str] | None]:
    """(line number, cells) of every non-empty row, and the header's cells when the first row is one. A quoted
    cell may hold a line break (the row is then one row, and its label is refused later, not cut in two); a
    table that csv cannot read (a cell over csv's limit, an unclosed quote) is refused naming the line."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); save the list as UTF-8") from None
    try:
        dialect = csv.Sniffer().sniff(text[:4096], delimiters=",\t;")
    except csv.Error:
        dialect = csv.excel
    reader = csv.reader(io.StringIO(text, newline=""), dialect)
    rows = []
    try:
        for r in reader:
            if any(c.strip() for c in r):
                rows.append((reader.line_num, r))
    except csv.Error as e:
        raise DataError(f"{path}, line {reader.line_num}: not a readable CSV row ({e}): a path,label list has short "
                        f"cells; fix or remove that line") from None
    if rows and _is_header(rows[0][1], path.parent):
        return rows[1:], [c.strip() for c in rows[0][1]]
    return rows, None


_SET_SEPARATORS = re.compile(r"[;|]")
SET_HEADERS = {"labels", "tags", "label_set", "label_list"}  # a column of label sets, named so
MAX_LABEL = 1024  # characters: a longer "label" is damage (a cell of a whole document), not a class name


def _label_set(text: str) -> str:
    """'scab; rust|scab' → 'rust;scab': the canonical form of a label set."""
    return ";".join(sorted({p.strip() for p in _SET_SEPARATORS.split(text) if p.strip()}))


def _binary_table(header: list[str] | None, rows) -> bool:
    """A header of a path and 2+ class columns, whose cells are mostly 0/1: one 0/1 column per class (a cell
    that is neither is that row's problem, not a reason to read the table another way)."""
    if not header or len(header) < 3:
        return False
    cells = [c.strip() for _, r in rows for c in r[1:] if c.strip()]
    return bool(cells) and sum(c in ("0", "1") for c in cells) >= 0.9 * len(cells)


def _list_mode(path: Path, header: list[str] | None, rows) -> tuple[str, str]:
    """("columns" | "sets" | "single", why) for the summary: how the list is read, and what decided it."""
    if _binary_table(header, rows):
        names = header[1:]
        bad = sorted({n for n in names if not n} | {n for n in names if names.count(n) > 1})
        if bad or len(names) != len(set(names)):
            raise DataError(f"{path}: the header of a 0/1 table names each class column once, with a name (empty or "
                            f"repeated: {', '.join(repr(n) for n in bad)}); fix the header row")
        return "columns", f"one 0/1 column per class ({len(names)} columns named by the header)"
    if header and len(header) > 1 and header[1].lower() in SET_HEADERS:
        return "sets", f"the header names the label column {header[1]!r}"
    first = next((n for n, r in rows if len(r) > 1 and _SET_SEPARATORS.search(r[1])), None)
    if first is not None:
        return "sets", f"line {first} holds a label set (labels joined by ';' or '|')"
    return "single", "one label per row (a label set would be 'a;b', or a header naming the column 'labels')"


def _check_row(root: Path, row: list[str], lineno: int, multilabel: bool = False) -> Item | Rejection:
    if len(row) < 2 or not row[0].strip() or (not row[1].strip() and not multilabel):
        return Rejection(f"<line {lineno}>", "bad-row", f"expected 'path,label', got {row!r}"[:300])
    raw = row[0].strip()
    labels = [p.strip() for p in _SET_SEPARATORS.split(row[1])] if multilabel else [row[1].strip()]
    odd = next((x for x in labels if len(x) > MAX_LABEL or any(ord(c) < 32 for c in x)), None)
    if odd is not None:
        what = "a line break or control character" if len(odd) <= MAX_LABEL else f"{len(odd)} characters"
        return Rejection(raw[:300], "bad-label", f"line {lineno}: a label holds {what}: {odd[:60]!r}")
    label = _label_set(row[1]) if multilabel else labels[0]
    full = Path(raw) if os.path.isabs(raw) else root / raw
    try:
        rel = full.resolve().relative_to(root.resolve())
    except ValueError:
        return Rejection(raw, "outside-root", f"resolves outside the list's folder {root}")
    except (OSError, RuntimeError) as e:  # a symlink loop in the path
        return Rejection(raw, "unreadable", f"{type(e).__name__}: {e}")
    if not full.exists():
        return Rejection(rel.as_posix(), "missing", "no such file")
    if not full.is_file():
        return Rejection(rel.as_posix(), "not-a-file", "a folder, named pipe, device or socket")
    return Item(rel.as_posix(), label, None)


def _as_label_sets(rows, columns: list[str]) -> tuple[list, list[Rejection]]:
    """Multi-hot rows (path, 0/1 per class) → (path, 'a;b') rows; a row with a cell that is neither 0 nor 1 (or
    empty), or with another number of cells than the header, is rejected naming the line and the column."""
    out, bad = [], []
    for n, r in rows:
        cells = [c.strip() for c in r[1:]]
        wrong = next(((columns[k] if k < len(columns) else f"#{k + 2}", c) for k, c in enumerate(cells)
                      if c not in ("0", "1", "")), None)
        if wrong is None and len(cells) != len(columns):
            wrong = ("", f"{len(cells)} cells for {len(columns)} columns")
        if wrong is not None:
            bad.append(Rejection(r[0].strip()[:300] or f"<line {n}>", "bad-label",
                                 f"line {n}, column {wrong[0]!r}: {wrong[1][:60]!r} is not 0 or 1"))
            continue
        out.append((n, [r[0], ";".join(c for c, v in zip(columns, cells) if v == "1")]))
    return out, bad


def from_list(list_file: Path) -> Source:
    """A CSV/TXT of path,label rows (header optional); paths relative to the list's own folder.

    Multi-label lists: a label set per row (`path,"rust;scab"`, ';' or '|' between labels, empty for none; a
    header naming the column 'labels' makes every row a set, even when none holds two), or one 0/1 column per
    class after the path, named by a header (`path,rust,scab`). The summary says which reading was chosen, and why."""
    root = list_file.parent
    rows, header = _read_rows(list_file)
    mode, why = _list_mode(list_file, header, rows)
    rejections: list[Rejection] = []
    if mode == "columns":
        rows, rejections = _as_label_sets(rows, header[1:])
    multilabel = mode != "single"
    items = []
    for lineno, row in rows:
        checked = _check_row(root, row, lineno, multilabel)
        (items if isinstance(checked, Item) else rejections).append(checked)
    if not items:
        raise DataError(f"{list_file}: no usable 'path,label' rows ({len(rejections)} rejected; read as "
                        f"{'multi' if multilabel else 'single'}-label: {why})")
    names = {n for i in items for n in i.label.split(";") if n} if multilabel else {i.label for i in items}
    classes = tuple(header[1:]) if mode == "columns" else class_order(names)
    notes = ((f"header row skipped: {','.join(header)!r}",) if header else ()) + _numeric_note(classes)
    notes += (f"read as a {'multi' if multilabel else 'single'}-label list: {why}",)
    if mode == "single" and header and len(header) > 2:
        notes += (f"columns after the label ignored: {', '.join(header[2:])}",)
    if multilabel:
        empty = sum(1 for i in items if not i.label)
        notes += (f"multi-label list: {len(classes)} labels, {empty} images with none",)
    return Source(root, tuple(items), tuple(rejections), classes, 0, notes, multilabel)


def discover(src: str | os.PathLike, exclude: Path | None = None) -> Source:
    """The items of SRC; `exclude` (the output folder, when it lies inside SRC) is never entered."""
    src = Path(src)
    if src.is_dir():
        return from_folder(src, exclude)
    if src.is_file() and src.suffix.lower() in LIST_SUFFIXES:
        return from_list(src)
    if not src.exists():
        raise ConfigError(f"{src} does not exist")
    raise ConfigError(f"{src}: expected a folder of class folders or a list file "
                      f"({', '.join(sorted(LIST_SUFFIXES))})")

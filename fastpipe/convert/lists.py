"""A CSV/TXT list of `path,label` rows as a `Source`, wherever the list is: on this machine's disk (`from_list`), or
in a store (listing.py fetches it and hands its bytes to `from_bytes`, with its own rule for where a row's path
points).

Paths are relative to the list's own folder. A header row is recognised by its words or by not naming a file, and
reported. Multi-label lists: a label set per row (`path,"rust;scab"`, ';' or '|' between labels, empty for none; a
header naming the column 'labels' makes every row a set, even when none holds two), or one 0/1 column per class
after the path, named by a header (`path,rust,scab`). A header naming the column 'label' (or 'class', ...) means one
label per row: a row holding a set is then rejected, not turned into a multi-label data set. Without a header that
says, a list holding both kinds of rows is refused. A row with more columns than the list has is rejected (an
unquoted comma would cut its label short). The summary says which reading was chosen, and why.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from fastpipe.convert.sources import Item, Rejection, Source, class_order, numeric_note
from fastpipe.errors import DataError
from fastpipe.store.urls import holds_secret, redact

LIST_SUFFIXES = {".csv", ".txt", ".tsv", ".lst"}
HEADER_WORDS = {"label", "labels", "class", "classes", "category", "target", "y", "class_id", "classid",
                "class_name", "label_id", "path", "file", "filename", "file_name", "image", "img", "image_path",
                "filepath", "id", "name"}


def _is_header(row: list[str], names_file: Callable[[str], bool]) -> bool:
    """The first row is a header when it names no file and reads like column names: a known word in either
    column, or a first cell with no folder separator and no file extension."""
    if len(row) < 2:
        return False
    first, second = row[0].strip(), row[1].strip()
    if names_file(first):
        return False
    words = {first.lower(), second.lower()}
    return bool(words & HEADER_WORDS) or ("/" not in first and "\\" not in first and "." not in first)


def _read_rows(data: bytes, where: str, names_file) -> tuple[list[tuple[int, list[str]]], list[str] | None]:
    """(line number, cells) of every non-empty row, and the header's cells when the first row is one. A quoted
    cell may hold a line break (the row is then one row, and its label is refused later, not cut in two); a
    table that csv cannot read (a cell over csv's limit, an unclosed quote) is refused naming the line."""
    try:  # line ends as text mode reads them (\r\n and \r become \n), wherever the list comes from
        text = data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e}); save the list as UTF-8") from None
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
        raise DataError(f"{where}, line {reader.line_num}: not a readable CSV row ({e}): a path,label list has short "
                        f"cells; fix or remove that line") from None
    if rows and _is_header(rows[0][1], names_file):
        return rows[1:], [c.strip() for c in rows[0][1]]
    return rows, None


_SET_SEPARATORS = re.compile(r"[;|]")
SET_HEADERS = {"labels", "tags", "label_set", "label_list"}  # a column of label sets, named so
SINGLE_HEADERS = {"label", "class", "category", "target", "y", "class_id", "classid", "class_name", "label_id",
                  "label_name"}  # a column of one label per row, named so
MAX_LABEL = 1024  # characters: a longer "label" is damage (a cell of a whole document), not a class name


def _label_set(text: str) -> str:
    """'scab; rust|scab' → 'rust;scab': the canonical form of a label set."""
    return ";".join(sorted({p.strip() for p in _SET_SEPARATORS.split(text) if p.strip()}))


def _zero_one(cells: list[str]) -> bool:
    return bool(cells) and sum(c in ("0", "1") for c in cells) >= 0.9 * len(cells)


def _binary_table(header: list[str] | None, rows) -> bool:
    """A header of a path and 2+ class columns, whose cells are mostly 0/1, or which names no label column and
    has a column of 0/1: one 0/1 column per class (a cell that is neither, even a whole column of yes/no, is its
    row's problem, not a reason to read the table as one label per row and drop the other columns)."""
    if not header or len(header) < 3:
        return False
    columns = [[r[k].strip() for _, r in rows if k < len(r) and r[k].strip()] for k in range(1, len(header))]
    if _zero_one([c for col in columns for c in col]):
        return True
    return header[1].strip().lower() not in SINGLE_HEADERS | SET_HEADERS and any(map(_zero_one, columns))


def _list_mode(where: str, header: list[str] | None, rows) -> tuple[str, str]:
    """("columns" | "sets" | "single", why) for the summary: how the list is read, and what decided it. A header
    naming the label column decides; without one, a list that holds both single labels and label sets is
    refused (which rows are mistakes cannot be told)."""
    if _binary_table(header, rows):
        return "columns", _column_names(where, header[1:])
    named = header[1].strip().lower() if header and len(header) > 1 else ""
    if named in SET_HEADERS:
        return "sets", f"the header names the label column {header[1]!r}"
    if named in SINGLE_HEADERS:
        return "single", (f"the header names the label column {header[1]!r}, one label per row (a header "
                          f"naming it 'labels' reads label sets)")
    sets = [n for n, r in rows if len(r) > 1 and _SET_SEPARATORS.search(r[1])]
    if not sets:
        return "single", "one label per row (a label set would be 'a;b', or a header naming the column 'labels')"
    single = [n for n, r in rows if len(r) > 1 and r[1].strip() and not _SET_SEPARATORS.search(r[1])]
    if single:
        raise DataError(f"{where}: some rows hold one label (lines {_first(single)}) and some a label set (lines "
                        f"{_first(sets)}); say which the list holds with a header row: 'path,labels' for label "
                        f"sets (multi-label), 'path,label' for one label per row")
    return "sets", f"line {sets[0]} holds a label set (labels joined by ';' or '|')"


def _first(lines: list[int], n: int = 3) -> str:
    return ", ".join(map(str, lines[:n])) + (", ..." if len(lines) > n else "")


def _column_names(where: str, names: list[str]) -> str:
    """The class names a 0/1 table's header gives, checked: each once, with a name, holding no ';' or '|' (what
    joins the names of a label set in the shards and the other readers' files)."""
    bad = sorted({n for n in names if not n} | {n for n in names if names.count(n) > 1})
    if bad:
        raise DataError(f"{where}: the header of a 0/1 table names each class column once, with a name (empty or "
                        f"repeated: {', '.join(repr(n) for n in bad)}); fix the header row")
    joined = [n for n in names if _SET_SEPARATORS.search(n)]
    if joined:
        raise DataError(f"{where}: the header of a 0/1 table names the class {joined[0]!r}: ';' and '|' join the "
                        f"labels of a label set, so a class name cannot hold them; rename that column")
    return f"one 0/1 column per class ({len(names)} columns named by the header)"


def _trimmed(row: list[str]) -> list[str]:
    """A row without its empty cells at the end (a spreadsheet's export pads rows with commas)."""
    end = len(row)
    while end > 2 and not row[end - 1].strip():
        end -= 1
    return row[:end]


def _width(header: list[str] | None, rows) -> int:
    """The list's number of columns: its header's, or the most common (the fewer of equals)."""
    if header:
        return max(len(_trimmed(header)), 2)
    counts = Counter(len(_trimmed(r)) for _, r in rows)
    return max(2, max(counts, key=lambda w: (counts[w], -w)) if counts else 2)


def _check_row(place, row: list[str], lineno: int, multilabel: bool = False, width: int = 2) -> Item | Rejection:
    """An item, or the row's rejection naming its line: no path or label, more columns than the list has (a
    comma in an unquoted label would otherwise lose the rest of it), a label set in a list of one label per row,
    or a label that is damage."""
    row = _trimmed(row)
    if len(row) < 2 or not row[0].strip() or (not row[1].strip() and not multilabel):
        shown = [redact(c) for c in row]  # before cutting to length: a cut URL would keep its secret
        return Rejection(f"<line {lineno}>", "bad-row", f"expected 'path,label', got {shown!r}"[:300])
    raw = row[0].strip()
    if len(row) > width:
        return Rejection(redact(raw)[:300], "bad-row", f"line {lineno}: {len(row)} columns where the list has {width}: "
                         f"quote a label that holds a comma (\"a,b\"), join a label set with ';'")
    if not multilabel and _SET_SEPARATORS.search(row[1]):
        return Rejection(redact(raw)[:300], "bad-label", f"line {lineno}: {redact(row[1].strip())[:60]!r} is a "
                         f"label set, but the list has one label per row; for a multi-label list name the label "
                         f"column 'labels'")
    labels = [p.strip() for p in _SET_SEPARATORS.split(row[1])] if multilabel else [row[1].strip()]
    odd = next((x for x in labels if len(x) > MAX_LABEL or any(ord(c) < 32 for c in x) or holds_secret(x)), None)
    if odd is not None:
        what = ("a URL's credentials or query value" if holds_secret(odd) else "a line break or control character"
                if len(odd) <= MAX_LABEL else f"{len(odd)} characters")
        return Rejection(redact(raw)[:300], "bad-label", f"line {lineno}: a label holds {what}: {redact(odd)[:60]!r}")
    label = _label_set(row[1]) if multilabel else labels[0]
    rel = place(raw)
    return rel if isinstance(rel, Rejection) else Item(rel, label, None)


def _local_place(root: Path, raw: str) -> str | Rejection:
    """A row's path in a list on this machine: inside the list's folder (links resolved), an existing file."""
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
    return rel.as_posix()


def _as_label_sets(rows, columns: list[str]) -> tuple[list, list[Rejection]]:
    """Multi-hot rows (path, 0/1 per class) → (path, 'a;b') rows; a row with a cell that is neither 0 nor 1 (or
    empty), or with another number of cells than the header, is rejected naming the line and the column."""
    out, bad = [], []
    for n, r in rows:
        cells = [c.strip() for c in _trimmed(r)[1:]]
        if len(cells) != len(columns):
            bad.append(Rejection(redact(r[0].strip())[:300] or f"<line {n}>", "bad-row",
                                 f"line {n}: {len(cells)} class cells where the header names {len(columns)}"))
            continue
        wrong = next(((columns[k], c) for k, c in enumerate(cells) if c not in ("0", "1", "")), None)
        if wrong is not None:
            bad.append(Rejection(redact(r[0].strip())[:300] or f"<line {n}>", "bad-label",
                                 f"line {n}, column {wrong[0]!r}: {redact(wrong[1])[:60]!r} is not 0 or 1"))
            continue
        out.append((n, [r[0], ";".join(c for c, v in zip(columns, cells) if v == "1")]))
    return out, bad


def from_list(list_file: Path, unlabelled: bool = False) -> Source:
    """A list on this machine's disk; each row's file is checked to exist (a missing one is rejected here)."""
    root = list_file.parent
    return from_bytes(list_file.read_bytes(), str(list_file), root, lambda raw: _local_place(root, raw),
                      lambda first: (root / first).is_file(), unlabelled=unlabelled)


def from_bytes(data: bytes, where: str, root, place, names_file=lambda first: False, files=None,
               unlabelled: bool = False) -> Source:
    """The Source of a list's bytes. `where` names the list in messages; `place(raw)` turns a row's path into the
    relative path of an item, or a Rejection; `names_file(cell)` says whether a first row's cell names a file.
    `unlabelled`: a list of paths alone is taken too (its items' labels are "": what `fastpipe predict` reads)."""
    rows, header = _read_rows(data, where, names_file)
    if unlabelled and header is None and _paths_only(rows):
        return _paths(rows, root, place, files)
    mode, why = _list_mode(where, header, rows)
    rejections: list[Rejection] = []
    notes = _notes(header, mode, why, rows)
    width = 2 if mode == "columns" else _width(header, rows)
    if mode == "columns":
        rows, rejections = _as_label_sets(rows, header[1:])
    elif width > 2:
        extra = header[2:] if header else [f"#{k}" for k in range(3, width + 1)]
        notes += (f"columns after the label ignored: {', '.join(extra)}",)
    multilabel = mode != "single"
    items = []
    for lineno, row in rows:
        checked = _check_row(place, row, lineno, multilabel, width)
        (items if isinstance(checked, Item) else rejections).append(checked)
    if not items:
        first = f", the first: {rejections[0].path[:100]}: {rejections[0].detail[:200]}" if rejections else ""
        raise DataError(f"{where}: no usable 'path,label' rows ({len(rejections)} rejected{first}; read as "
                        f"{'multi' if multilabel else 'single'}-label: {why})")
    names = {n for i in items for n in i.label.split(";") if n} if multilabel else {i.label for i in items}
    classes = tuple(header[1:]) if mode == "columns" else class_order(names)
    if any(map(holds_secret, classes)):  # a class name is written (dataset.json, previews' names): never a secret
        raise DataError(f"{where}: a class column's name holds a URL's credentials or query value "
                        f"({', '.join(redact(c) for c in classes if holds_secret(c))}): rename it in the header row")
    notes += numeric_note(classes)
    if multilabel:
        notes += (f"multi-label list: {len(classes)} labels",)
    return Source(root, tuple(items), tuple(rejections), classes, 0, notes, multilabel, files)


def _paths_only(rows) -> bool:
    return bool(rows) and all(r and r[0].strip() and not any(c.strip() for c in r[1:]) for _, r in rows)


def _paths(rows, root, place, files) -> Source:
    """A list of one path per row (a header word alone on the first row is skipped), without labels."""
    if rows[0][1][0].strip().lower() in HEADER_WORDS:
        rows = rows[1:]
    items, rejections = [], []
    for _, row in rows:
        rel = place(row[0].strip())
        (rejections if isinstance(rel, Rejection) else items).append(rel if isinstance(rel, Rejection)
                                                                      else Item(rel, "", None))
    return Source(root, tuple(items), tuple(rejections), (), 0, ("a list of paths without labels",), False, files)


def _notes(header: list[str] | None, mode: str, why: str, rows) -> tuple[str, ...]:
    """What the summary says of how the list was read (and how to have it read otherwise)."""
    notes = (f"header row skipped: {','.join(header)!r}",) if header else ()
    notes += (f"read as a {'single' if mode == 'single' else 'multi'}-label list: {why}",)
    sets = [n for n, r in rows if len(r) > 1 and _SET_SEPARATORS.search(r[1])] if mode == "single" else []
    if sets:
        notes += (f"{len(sets)} rows hold a label set (line {_first(sets)}): rejected as bad-label in a list of one "
                  f"label per row; for a multi-label list name the label column 'labels' (header 'path,labels')",)
    return notes

"""The shard format, in one place: WebDataset tars with a DALI index (`.idx`) beside each.

Everything that reads or writes shards, indexes or labels goes through here (the converter, the loaders, previews,
inspect, `fastpipe index`), so a damaged file is reported the same way everywhere: a `DataError` naming the file,
the line or member, and the command that fixes it.

- A sample is the tar members sharing a key (webdataset's rule: the key ends at the first dot of the file name).
- `.idx` (DALI's `wds2idx` format v1.2): `v1.2 <samples>`, then per sample `<ext> <data offset> <size> <name>` for
  each of its members, offsets in bytes (multiples of the 512-byte block).
- Labels: `KEY.cls` ASCII decimal (webdataset's convention) and `KEY.lbl` int32 little-endian (for DALI's reader
  without per-sample Python).
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import numpy as np

from fastpipe.errors import DataError
from fastpipe.util import atomic_write_text

BLOCK = 512
IDX_VERSION = "v1.2"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "label", "class", "index", "target")
MAX_LABEL_BYTES = 64  # an ASCII class index; a larger label member is damage, not a label

IndexEntry = tuple[str, dict[str, tuple[int, int]]]  # (key, {ext: (data offset, size)})


def _ustar_template() -> bytes:
    """A header's constant fields (mode 0444, owner 0, mtime 0, a regular file, USTAR magic), checksum blank."""
    head = bytearray(BLOCK)
    head[100:124] = b"0000444\0" + b"0000000\0" * 2
    head[136:157] = b"00000000000\0" + b" " * 8 + b"0"
    head[257:265] = tarfile.POSIX_MAGIC
    return bytes(head)


_USTAR = _ustar_template()


def tar_header(name: str, size: int) -> bytes:
    """A USTAR header with mtime 0 and no owner: byte-identical shards across runs, and cheaper to read than PAX.

    Built here, a quarter of the time of tarfile's generic encoders (benchmarks/bench_io.py), with the same bytes
    as tarfile's USTAR header (tested); tarfile still makes (or refuses) the header of a name over 100 bytes,
    which USTAR splits into prefix and name, or of a member of 8 GiB or more."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or size >= 8**11:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, 0, 0o444
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8")
    head = bytearray(_USTAR)
    head[: len(raw)] = raw
    head[124:136] = b"%011o\0" % size
    head[148:155] = b"%06o\0" % sum(head)
    return bytes(head)


def member_chunk(name: str, data: bytes) -> bytes:
    return tar_header(name, len(data)) + data + b"\0" * (-len(data) % BLOCK)


def headers_match(blocks: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which rows of `blocks` (512 bytes each) are tar headers of members of these sizes: a checksum that adds up
    and the size field. Rows are the header before each sample's image, as the index places it (its data offset
    - 512): a shard replaced after conversion fails it. Fields as fastpipe, tarfile and GNU tar write them are
    compared at once; a row in any other encoding (spaces, a signed checksum) is read by tarfile's own rules."""
    sums = blocks.sum(1, dtype=np.int64) - blocks[:, 148:156].sum(1, dtype=np.int64) + 8 * ord(" ")
    ok = (blocks[:, 124:135] == _octal_digits(sizes, 11)).all(1) & (blocks[:, 148:154] == _octal_digits(sums, 6)).all(1)
    for r in np.flatnonzero(~ok):
        ok[r] = _header_says(bytes(blocks[r]), int(sizes[r]))
    return ok


def range_as_indexed(data: bytes, start: int, heads: np.ndarray) -> bool:
    """Whether the tar header before each image member in `data` (a range of a shard from byte `start`) is where
    the index puts it and of its size. `heads`: rows of (header offset in the shard, member size)."""
    pad = -start % BLOCK  # headers lie on the shard's 512-byte blocks: the range's, from its first whole one
    blocks = np.frombuffer(data, np.uint8, offset=pad, count=(len(data) - pad) // BLOCK * BLOCK).reshape(-1, BLOCK)
    return bool(headers_match(blocks[(heads[:, 0] - start - pad) // BLOCK], heads[:, 1]).all())


def _octal_digits(values: np.ndarray, width: int) -> np.ndarray:
    """Each value as `width` zero-padded octal digits (ASCII), one row each."""
    return (((values[:, None] >> (3 * np.arange(width - 1, -1, -1))) & 7) + ord("0")).astype(np.uint8)


def _header_says(block: bytes, size: int) -> bool:
    try:
        return tarfile.nti(block[124:136]) == size and tarfile.nti(block[148:156]) in tarfile.calc_chksums(block)
    except (tarfile.HeaderError, ValueError):
        return False


def sample_bytes(parts: dict[str, bytes]) -> int:
    """Bytes a sample takes in a tar: a header block per member and its data padded to whole blocks."""
    return sum(BLOCK + -(-len(v) // BLOCK) * BLOCK for v in parts.values())


def split_name(name: str) -> tuple[str, str]:
    """webdataset's rule: the key ends at the first dot of the file name (not of the folders)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])


def index_line(fields: list[tuple[str, int, int, str]]) -> str:
    return " ".join(f"{ext} {off} {size} {name}" for ext, off, size, name in fields)


def entry_line(key: str, parts: dict[str, tuple[int, int]]) -> str:
    """The `.idx` line of one parsed entry, members in file order (as wds2idx writes them)."""
    return index_line([(ext, off, size, f"{key}.{ext}")
                       for ext, (off, size) in sorted(parts.items(), key=lambda x: x[1][0])])


def write_index(path: Path, lines: list[str]) -> None:
    atomic_write_text(path, f"{IDX_VERSION} {len(lines)}\n" + "".join(line + "\n" for line in lines))


def read_index(path: Path, shard_bytes: int | None = None) -> list[IndexEntry]:
    """Parse and check a `.idx`: per sample (key, {ext: (offset, size)}). With `shard_bytes`, every member must lie
    inside the shard. Any damage raises DataError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise _idx_error(path, 1, f"unreadable ({type(e).__name__}: {e})") from e
    return parse_index(text, path, shard_bytes)


def parse_index(text: str | bytes, path, shard_bytes: int | None = None) -> list[IndexEntry]:
    """`read_index` of an index's text (fetched from a store); `path` names it in errors."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError as e:
            raise _idx_error(path, 1, f"unreadable ({type(e).__name__}: {e})") from e
    lines = text.splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != IDX_VERSION or not head[1].isdigit() or int(head[1]) != len(lines) - 1:
        raise _idx_error(path, 1, f"expected '{IDX_VERSION} <samples>' for {len(lines) - 1} sample lines, "
                                  f"got {lines[0][:60]!r}" if lines else "empty file")
    entries, seen = [], set()
    for n, line in enumerate(lines[1:], start=2):
        key, parts = _parse_line(path, n, line, shard_bytes)
        if key in seen:
            raise _idx_error(path, n, f"key {key!r} appears twice")
        seen.add(key)
        entries.append((key, parts))
    return entries


def _parse_line(path: Path, n: int, line: str, shard_bytes: int | None) -> IndexEntry:
    f = line.split(" ")
    if not f or len(f) % 4:
        raise _idx_error(path, n, f"expected groups of '<ext> <offset> <size> <name>', got {line[:80]!r}")
    parts, key = {}, None
    for i in range(0, len(f), 4):
        ext, off, size, name = f[i : i + 4]
        if not (off.isdigit() and size.isdigit()):
            raise _idx_error(path, n, f"offset/size of {name!r} are not numbers: {off!r} {size!r}")
        off_i, size_i = int(off), int(size)
        if off_i < BLOCK or off_i % BLOCK or (shard_bytes is not None and off_i + size_i > shard_bytes):
            raise _idx_error(path, n, f"member {name!r} at byte {off_i} (+{size_i}) is not inside the shard "
                                      f"({shard_bytes} bytes)")
        k = split_name(name)[0]
        if key is not None and k != key:
            raise _idx_error(path, n, f"members of two samples on one line ({key!r}, {k!r})")
        key, parts[ext] = k, (off_i, size_i)
    return key, parts


def _idx_error(path, line: int, what: str) -> DataError:
    tar = str(path)[: -len(".idx")] + ".tar" if str(path).endswith(".idx") else path
    return DataError(f"index {path}, line {line}: {what}. Rebuild it from its shard: "
                     f"`fastpipe index --idx-only {tar}`")


def index_tar(tar_path: Path | str, fileobj=None, size: int | None = None) -> list[IndexEntry]:
    """The index of any tar (shards written by other tools), read with tarfile and checked member by member:
    only regular files, inside the file, names without spaces (DALI's format), each (key, ext) once, a sample's
    members next to each other. Raises DataError naming the shard and member. With `fileobj` (and its `size`), the
    tar is read from it (a shard in a store, its headers fetched by ranges), `tar_path` names it."""
    tar_path = Path(tar_path) if fileobj is None else tar_path
    size = tar_path.stat().st_size if fileobj is None else size
    entries: list[IndexEntry] = []
    done: set[str] = set()
    try:
        with tarfile.open(tar_path if fileobj is None else None, mode="r:", fileobj=fileobj) as tf:
            for m in tf:
                _check_member(tar_path, m, size)
                if m.isdir():
                    continue
                key, ext = split_name(m.name)
                if not entries or entries[-1][0] != key:
                    if key in done:
                        raise DataError(f"{tar_path}: member {m.name!r} belongs to key {key!r}, whose other members "
                                        f"came earlier (a sample's members must be adjacent, each key once)")
                    done.add(key)
                    entries.append((key, {}))
                if ext in entries[-1][1]:
                    raise DataError(f"{tar_path}: member {m.name!r} appears twice")
                entries[-1][1][ext] = (m.offset_data, m.size)
    except (tarfile.TarError, EOFError) as e:
        raise DataError(f"{tar_path}: not a readable tar file ({type(e).__name__}: {e})") from e
    return entries


def _check_member(tar_path: Path, m: tarfile.TarInfo, file_size: int) -> None:
    if m.isdir():
        return
    if not m.isfile():
        kind = "a symlink" if m.issym() else "a hard link" if m.islnk() else "not a regular file"
        raise DataError(f"{tar_path}: member {m.name!r} is {kind}; shards must hold regular files only "
                        f"(re-create the tar without links, e.g. `tar --dereference`)")
    if m.offset_data + m.size > file_size:
        raise DataError(f"{tar_path}: member {m.name!r} claims {m.size} bytes at byte {m.offset_data}, beyond the "
                        f"end of the file ({file_size} bytes): a truncated or damaged tar")
    key, ext = split_name(m.name)
    if not ext or not key or key.endswith("/") or any(c.isspace() for c in m.name):
        raise DataError(f"{tar_path}: member name {m.name!r} is not KEY.EXT without spaces "
                        f"(webdataset's naming, and DALI's index cannot hold spaces)")


def read_member(fh, where: tuple[int, int]) -> bytes:
    fh.seek(where[0])
    data = fh.read(where[1])
    if len(data) != where[1]:
        raise DataError(f"{getattr(fh, 'name', 'shard')}: ends inside a member at byte {where[0] + len(data)} "
                        f"(expected {where[1]} bytes at {where[0]}): the file is truncated")
    return data


def encode_label(label: int | tuple[int, ...], num_classes: int | None = None) -> dict[str, bytes]:
    """A single label: `cls` ASCII decimal and `lbl` int32. A label set (multi-label data): `labels` the class
    indices comma-separated ("1,3"; empty for none: not `.cls`, which webdataset decodes as one int) and `lbl` a
    multi-hot record of num_classes bytes (fixed size, so DALI's reader takes it as a UINT8 array)."""
    if isinstance(label, tuple):
        hot = np.zeros(num_classes, np.uint8)
        hot[list(label)] = 1
        return {"labels": ",".join(map(str, label)).encode(), "lbl": hot.tobytes()}
    return {"cls": str(label).encode(), "lbl": np.int32(label).tobytes()}


def label_array(labels: list, num_classes: int, multilabel: bool) -> np.ndarray:
    """int64 class indices, or for multi-label data float32 multi-hot rows (N, K)."""
    if not multilabel:
        return np.array(labels, dtype=np.int64).reshape(len(labels))
    hot = np.zeros((len(labels), num_classes), dtype=np.float32)
    for row, ks in enumerate(labels):
        hot[row, list(ks)] = 1.0
    return hot


def decode_label(data: bytes, ext: str, multilabel: bool = False) -> int | tuple[int, ...]:
    """A label member's class index, or for multi-label data the sorted tuple of class indices; raises ValueError
    with what was found (callers add the shard and key)."""
    if multilabel:
        if ext == "lbl":
            return tuple(int(i) for i in np.flatnonzero(np.frombuffer(data, np.uint8)))
        text = data.decode("ascii", errors="replace").strip()
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if len(data) > 16 * MAX_LABEL_BYTES or not all(p.isdigit() for p in parts):
            raise ValueError(f".{ext} is {text[:30]!r}, not comma-separated class indices")
        return tuple(sorted({int(p) for p in parts}))
    if ext == "lbl":
        if len(data) != 4:
            raise ValueError(f".lbl holds {len(data)} bytes, expected 4 (int32)")
        return int(np.frombuffer(data, "<i4")[0])
    if len(data) > MAX_LABEL_BYTES:
        raise ValueError(f".{ext} holds {len(data)} bytes, not a class index")
    text = data.decode("ascii", errors="replace").strip()
    if not (text.isdigit() or (text.startswith("-") and text[1:].isdigit())):
        raise ValueError(f".{ext} is {text[:20]!r}, not an integer class index")
    return int(text)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def index_path_for(tar: Path) -> Path:
    tar = Path(tar)
    return tar.with_suffix(".idx") if tar.suffix == ".tar" else tar.with_name(tar.name + ".idx")


__all__ = ["BLOCK", "IDX_VERSION", "IMAGE_EXTS", "LABEL_EXTS", "decode_label", "encode_label", "headers_match",
           "index_tar", "parse_index", "read_index", "read_member", "sha256_file", "split_name", "write_index"]

"""`fastpipe index SHARDS...`: adopt WebDataset shards written by other tools (e.g. webdataset.ShardWriter).

Writes a `.idx` beside each shard and a dataset.json (counts, class list, mean/std from a sample of decoded
images), so that every other command works on them unchanged. Everything a loader worker would trip over (links,
duplicate keys, a member beyond the end of the file, a label that is not a class index, mixed image types) is
refused here, naming the shard and member. No image is decoded (for mean/std or the previews) before its header
passes imageguard.check (--max-pixels, recorded in dataset.json for the loaders, and the scan limit); one that does
not, or does not decode, is left out, named in dataset.json (`settings.undecoded`) and said. `--idx-only` writes
the `.idx` files and nothing else: the repair for a missing or damaged index that never touches a manifest. Shards
already in a store are walked where they are, by ranged reads of their tar headers (adopt.py).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image
from tqdm import tqdm

from fastpipe.convert import outputs, previews, readers
from fastpipe.dataset import imageguard
from fastpipe.dataset.manifest import MANIFEST_NAME, Components, Manifest, ShardInfo, SplitInfo, Stats, save
from fastpipe.dataset.shardformat import (
    IMAGE_EXTS,
    LABEL_EXTS,
    decode_label,
    entry_line,
    index_path_for,
    index_tar,
    read_member,
    sha256_file,
    write_index,
)
from fastpipe.errors import ConfigError, DataError
from fastpipe.options import check, opt
from fastpipe.store.location import in_stores
from fastpipe.store.remote import Remote
from fastpipe.store.urls import local_path
from fastpipe.util import FolderLock, parse_json

MAX_CLASSES = 100_000  # without --classes, a label above this is damage, not a class index
MAX_STATS_IMAGE = 64 * 1024**2
VAL_NAME = re.compile(r"(^|[-_.])(val|valid|validation)([-_.]|$)", re.IGNORECASE)


@dataclass(frozen=True)
class IndexConfig:
    train: list[Path] = opt(None, "shard files (train; validation shards with --val, or named val-*)",
                            positional=True, nargs="+", flag="SHARDS")
    out: Path | None = opt(None, "where dataset.json and the .idx files go (default: the shards' folder); for "
                                 "shards in a store, a folder or another store's URL: the shards stay where they are")
    val: list[Path] = opt([], "validation shard files", nargs="*")
    classes_file: str | None = opt(None, "text file of class names, one per line, in label order", flag="--classes")
    stats_samples: int = opt(2000, "train images decoded for mean/std", low=1, high=10_000_000)
    max_pixels: int = opt(imageguard.DEFAULT_MAX_PIXELS, "refuse to decode larger images (decompression-bomb guard): "
                          "left out of mean/std and previews here, skipped by the loaders", low=1)
    idx_only: bool = opt(False, "write the .idx files only (a missing or damaged index); no manifest is touched")
    overwrite: bool = opt(False, "replace an existing dataset.json in the folder")

    def __post_init__(self):
        check(self)


@dataclass
class _Scan:
    samples: int = 0
    labels: Counter = field(default_factory=Counter)
    image_exts: Counter = field(default_factory=Counter)
    label_exts: Counter = field(default_factory=Counter)
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (shard/key, image bytes) for mean/std


def _label(tar: Path, fh, key: str, parts: dict, limit: int) -> tuple[str, int]:
    ext = next((e for e in LABEL_EXTS if e in parts), None)
    if ext is None:
        raise DataError(f"{tar}: sample {key!r} has no label member (.{' .'.join(LABEL_EXTS)}); "
                        f"it has {', '.join(sorted(parts))}")
    try:
        label = decode_label(read_member(fh, parts[ext]), ext)
    except ValueError as e:
        raise DataError(f"{tar}: member {key}.{ext}: {e}; write integer class indexes (0..K-1) as labels") from None
    if not 0 <= label < limit:
        raise DataError(f"{tar}: member {key}.{ext} holds label {label}, outside 0..{limit - 1}"
                        + ("" if limit != MAX_CLASSES else "; pass --classes FILE if there really are that many"))
    return ext, label


def _scan(tar: Path, keep: int, scan: _Scan, limit: int) -> list[str]:
    """Check one shard sample by sample; returns its `.idx` lines."""
    entries = index_tar(tar)
    with open(tar, "rb") as fh:
        scan_entries(tar, fh, entries, keep, scan, limit)
    return [entry_line(k, p) for k, p in entries]


def scan_entries(tar, fh, entries: list, keep: int, scan: _Scan, limit: int) -> list[tuple[int, tuple[int, int]]]:
    """Check a shard's samples (`entries`, read from `fh`); count them into `scan`, keep up to `keep` images for
    mean/std. Returns each sample's (label, (offset, size) of its image)."""
    out = []
    for key, parts in entries:
        images = [e for e in parts if e in IMAGE_EXTS]
        if len(images) != 1:
            raise DataError(f"{tar}: sample {key!r} has {len(images)} image members ({', '.join(sorted(parts))}); "
                            f"each sample needs exactly one of .{' .'.join(IMAGE_EXTS)}")
        label_ext, label = _label(tar, fh, key, parts, limit)
        scan.labels[label] += 1
        scan.image_exts[images[0]] += 1
        scan.label_exts[label_ext] += 1
        if len(scan.images) < keep and parts[images[0]][1] <= MAX_STATS_IMAGE:
            scan.images.append((f"{Path(str(tar)).name}/{key}", read_member(fh, parts[images[0]])))
        out.append((label, parts[images[0]]))
    scan.samples += len(entries)
    return out


def _one(counter: Counter, what: str, shards: str) -> str | None:
    if len(counter) > 1:
        mix = ", ".join(f"{n} .{e}" for e, n in counter.most_common())
        raise DataError(f"{shards}: the samples mix {what} types ({mix}); fastpipe needs one {what} type per data "
                        f"set: re-write the shards with one (or convert the images with `fastpipe shard`)")
    return next(iter(counter), None)


def _stats(images: list[tuple[str, bytes]], max_pixels: int) -> tuple[Stats, list[str]]:
    """Mean/std sums of the images that pass the header checks and decode; 'shard/key: why' for the others."""
    total, undecoded = Stats.zero(), []
    for name, data in tqdm(images, desc="mean/std", unit="img", leave=False):
        try:
            imageguard.check(data, max_pixels)
            im = Image.open(io.BytesIO(data)).convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            undecoded.append(f"{name}: {type(e).__name__}: {e}"[:300])  # the loaders skip it; inspect --verify too
            continue
        h = np.asarray(im.histogram(), dtype=np.float64).reshape(3, 256)
        v = np.arange(256) / 255.0
        total = total + Stats(im.width * im.height, tuple(h @ v), tuple(h @ (v * v)))
    return total, undecoded


def _inside(path: Path, out: Path) -> str:
    try:
        return path.resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        raise ConfigError(f"{path} is not inside {out}: dataset.json lists shards by paths inside its own folder; "
                          f"drop --out (the manifest goes beside the shards) or move the shards into {out}") from None


def _split_files(cfg: IndexConfig) -> tuple[list[Path], list[Path], str | None]:
    train = [local_path(p, "shard") for p in cfg.train]
    val = [local_path(p, "shard") for p in cfg.val]
    for p in train + val:
        if not p.is_file():
            raise ConfigError(f"{p}: no such shard file")
    if cfg.idx_only:
        return train, val, None
    return split_by_name(train, val)


def split_by_name(train: list, val: list) -> tuple[list, list, str | None]:
    """(train, val, a note): without --val, the shards named like validation shards (a path or a name each) form
    the val split, when some of them are and some are not."""
    if val:
        return train, val, None
    found = [p for p in train if VAL_NAME.search(PurePosixPath(str(p)).name.split(".")[0])]
    if found and len(found) < len(train):
        return [p for p in train if p not in found], found, f"{len(found)} shards named like validation shards " \
                                                            f"({PurePosixPath(str(found[0])).name}, ...) form the " \
                                                            f"val split"
    return train, val, None


def _index_split(paths: list[Path], out: Path, keep: int, scan: _Scan, limit: int) -> list[ShardInfo]:
    shards = []
    for tar in tqdm(paths, desc="indexing", unit="shard", leave=False):
        lines = _scan(tar, keep, scan, limit)
        if not lines:  # a manifest listing it would be refused by every loader: say so now, naming the file
            raise DataError(f"{tar} holds no samples (an empty or image-less tar): leave it out of the command")
        idx = index_path_for(tar)
        write_index(idx, lines)
        shards.append(ShardInfo(_inside(tar, out), len(lines), tar.stat().st_size, sha256_file(tar),
                                _inside(idx, out)))
    return shards


def _classes(cfg: IndexConfig) -> tuple[str, ...] | None:
    if not cfg.classes_file:
        return None
    names = tuple(x.strip() for x in Path(cfg.classes_file).read_text().splitlines() if x.strip())
    if len(set(names)) != len(names) or not names:
        raise ConfigError(f"--classes {cfg.classes_file}: needs distinct names, one per line")
    return names


def _guard(out: Path, shard_paths: set[str], overwrite: bool) -> None:
    existing, problem = outputs.read_manifest(out / MANIFEST_NAME)
    same = existing is not None and existing.foreign and {
        s.path for sp in existing.splits.values() for s in sp.shards} == shard_paths
    if (existing is not None or problem) and not same and not overwrite:
        raise ConfigError(f"{out / MANIFEST_NAME} already describes a data set; `fastpipe index` would replace it. "
                          f"To rebuild only missing or damaged .idx files: `fastpipe index --idx-only SHARDS...`; "
                          f"to replace the manifest: add --overwrite")


def _users_files(out: Path, names: list[str]) -> set[str]:
    """Reader files in the shards' folder that no manifest of ours lists (timm's `_info.json` of the tool that
    wrote the shards, say): the user's, kept."""
    existing, _ = outputs.read_manifest(out / MANIFEST_NAME)
    owned = outputs.manifest_files(existing) if existing is not None else set()
    return {p.name for p in outputs.foreign_conflicts(out, [], owned, names)}


def users_reader_files(remote: Remote) -> list[str]:
    """Reader files (convert/readers.py) in the store that no dataset.json of ours there lists: the user's."""
    ours = []
    if remote.exists(MANIFEST_NAME):
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            ours = list(parse_json(remote.cat(MANIFEST_NAME)).get("outputs", {}).get("readers", []))
    return [n for n in readers.names(("train", "val")) if n not in ours and remote.exists(n)]


def index_only(paths: list[Path]) -> int:
    """Write the .idx of each shard (nothing else). Returns the samples indexed."""
    total = 0
    for tar in tqdm(paths, desc="indexing", unit="shard", leave=False):
        entries = index_tar(tar)
        write_index(index_path_for(tar), [entry_line(k, p) for k, p in entries])
        total += len(entries)
    return total


def index_shards(cfg: IndexConfig) -> Manifest:
    if in_stores([*cfg.train, *cfg.val]):  # walked where they are: adopt.index_where_they_are
        raise ConfigError("index_shards takes local shards; shards in a store: adopt.index_where_they_are")
    train, val, note = _split_files(cfg)
    out = local_path(cfg.out, "--out") if cfg.out else train[0].parent
    shard_paths = {_inside(p, out) for p in train + val}
    with FolderLock(out, "fastpipe index"):
        _guard(out, shard_paths, cfg.overwrite)
        names = _classes(cfg)
        limit = len(names) if names else MAX_CLASSES
        scans = {"train": _Scan(), "val": _Scan()}
        shards = {"train": _index_split(train, out, cfg.stats_samples, scans["train"], limit),
                  "val": _index_split(val, out, 0, scans["val"], limit)}
        manifest = build(cfg, names, scans, shards, out, {**({"note": note} if note else {})})
        names_ = previews.contact_sheets(manifest, out / "previews")
        manifest.outputs["previews"] = {c: f"previews/{f}" for c, f in names_.items()}
        users = _users_files(out, readers.names(manifest.splits))
        manifest.outputs["readers"] = readers.write(manifest, out, keep=users)
        save(manifest, out)
    return manifest


def build(cfg: IndexConfig, names, scans: dict[str, _Scan], shards: dict[str, list[ShardInfo]], out: Path,
          settings: dict) -> Manifest:
    """The manifest of indexed shards: one image and one label type, the classes, counts and mean/std."""
    both = scans["train"].image_exts + scans["val"].image_exts
    image_ext = _one(both, "image", f"{out}") or "jpg"
    label_ext = _one(scans["train"].label_exts + scans["val"].label_exts, "label", f"{out}") or "cls"
    num = max([*scans["train"].labels, *scans["val"].labels, -1]) + 1
    classes = names or tuple(str(i) for i in range(num))
    splits = {name: SplitInfo(tuple(sh), tuple(scans[name].labels.get(i, 0) for i in range(len(classes))))
              for name, sh in shards.items()}
    stats, undecoded = _stats(scans["train"].images, cfg.max_pixels)
    return Manifest(classes, splits, stats,
                    {"indexed_from": "foreign shards", "max_pixels": cfg.max_pixels,
                     "stats_from_samples": len(scans["train"].images) - len(undecoded),
                     **({"undecoded": undecoded} if undecoded else {}), **settings},
                    Components(image=image_ext, label=label_ext, label_bin=None, meta=None), out)



"""`fastpipe index SHARDS...`: adopt WebDataset shards written by other tools (e.g. webdataset.ShardWriter).

Writes a `.idx` beside each shard and a dataset.json (counts, class list, mean/std from a sample of
decoded train images), so that every other command works on them unchanged.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from fastpipe.convert import previews
from fastpipe.convert.writer import index_lines_of, sha256_file, split_name, write_index_file
from fastpipe.manifest import Components, Manifest, ShardInfo, SplitInfo, Stats, save

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "label", "class", "index", "target")


@dataclass(frozen=True)
class IndexConfig:
    train: list[Path]
    out: Path | None = None
    val: list[Path] = field(default_factory=list)
    classes_file: str | None = None
    stats_samples: int = 2000


@dataclass
class _Scan:
    samples: int = 0
    labels: Counter = field(default_factory=Counter)
    exts: Counter = field(default_factory=Counter)
    images: list[bytes] = field(default_factory=list)


def _scan(tar_path: Path, keep_images: int, scan: _Scan) -> int:
    """Count samples, read labels, keep a few images for statistics. Returns this shard's sample count."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    with tarfile.open(tar_path) as tf:
        for m in tf:
            if m.isfile():
                key, ext = split_name(m.name)
                groups.setdefault(key, {})[ext] = m
        for key, parts in groups.items():
            scan.exts.update(parts.keys())
            label_ext = next((e for e in LABEL_EXTS if e in parts), None)
            if label_ext is None:
                raise ValueError(f"{tar_path}: sample {key!r} has no label ({'/'.join(LABEL_EXTS)} member)")
            raw = tf.extractfile(parts[label_ext]).read().decode().strip()
            if not raw.lstrip("-").isdigit():
                raise ValueError(f"{tar_path}: label {raw!r} is not an integer class index; "
                                 f"re-write the shards with integer .cls labels")
            scan.labels[int(raw)] += 1
            img_ext = next((e for e in IMAGE_EXTS if e in parts), None)
            if img_ext and len(scan.images) < keep_images:
                scan.images.append(tf.extractfile(parts[img_ext]).read())
    scan.samples += len(groups)
    return len(groups)


def _stats(images: list[bytes]) -> Stats:
    total = Stats.zero()
    for data in tqdm(images, desc="mean/std", unit="img", leave=False):
        a = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64).reshape(-1, 3) / 255
        total = total + Stats(len(a), tuple(a.sum(0)), tuple((a * a).sum(0)))
    return total


def _rel(path: Path, root: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), root.resolve())
    except ValueError:
        return str(path.resolve())


def _index_split(paths: list[Path], out: Path, keep: int, scan: _Scan) -> list[ShardInfo]:
    shards = []
    for tar in tqdm(paths, desc="indexing", unit="shard", leave=False):
        if not tar.is_file():
            raise ValueError(f"{tar}: no such shard file")
        n = _scan(tar, keep, scan)
        idx = out / (tar.name[: -len(".tar")] + ".idx") if tar.name.endswith(".tar") else out / (tar.name + ".idx")
        write_index_file(idx, index_lines_of(tar))
        shards.append(ShardInfo(_rel(tar, out), n, tar.stat().st_size, sha256_file(tar), _rel(idx, out)))
    return shards


def index_shards(cfg: IndexConfig) -> Manifest:
    out = Path(cfg.out or cfg.train[0].parent)
    out.mkdir(parents=True, exist_ok=True)
    train_scan, val_scan = _Scan(), _Scan()
    splits_shards = {"train": _index_split(cfg.train, out, cfg.stats_samples, train_scan),
                     "val": _index_split(cfg.val, out, 0, val_scan)}
    num = max([*train_scan.labels, *val_scan.labels, -1]) + 1
    if cfg.classes_file:
        classes = tuple(x.strip() for x in Path(cfg.classes_file).read_text().splitlines() if x.strip())
        if len(classes) < num:
            raise ValueError(f"{cfg.classes_file}: {len(classes)} names, but labels go up to {num - 1}")
    else:
        classes = tuple(str(i) for i in range(num))
    image_ext = next((e for e in IMAGE_EXTS if e in train_scan.exts), "jpg")
    label_ext = next((e for e in LABEL_EXTS if e in train_scan.exts), "cls")
    splits = {name: SplitInfo(tuple(sh), tuple(scan.labels.get(i, 0) for i in range(len(classes))))
              for (name, sh), scan in zip(splits_shards.items(), (train_scan, val_scan))}
    manifest = Manifest(classes, splits, _stats(train_scan.images),
                        {"indexed_from": "foreign shards", "stats_from_samples": len(train_scan.images)},
                        Components(image=image_ext, label=label_ext, label_bin=None, meta=None), out)
    save(manifest, out)
    previews.contact_sheets(manifest, out / "previews")
    return manifest

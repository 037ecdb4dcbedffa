"""The `dataset.json` schema: the one place that reads, writes and validates it.

Everything a later stage needs (classes, counts, shard list, mean/std, class weights) is computed once at
conversion and read from here; nothing re-scans the shards at training time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "fastpipe-dataset"
VERSION = 1
MANIFEST_NAME = "dataset.json"


class ManifestError(ValueError):
    """dataset.json is missing, unreadable, or does not describe the shards next to it."""


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the manifest's folder (or absolute for shards indexed in place)
    samples: int
    bytes: int
    sha256: str
    index: str  # the DALI index file (wds2idx format) beside the shard


@dataclass(frozen=True)
class SplitInfo:
    shards: tuple[ShardInfo, ...]
    class_counts: tuple[int, ...]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)


@dataclass(frozen=True)
class Stats:
    """Per-channel statistics of the stored train images, 0..1 scale.

    The raw sums are kept so that manifests of separately converted parts merge exactly.
    """

    pixels: int
    sum: tuple[float, float, float]
    sumsq: tuple[float, float, float]

    @property
    def mean(self) -> tuple[float, ...]:
        return tuple(s / max(self.pixels, 1) for s in self.sum)

    @property
    def std(self) -> tuple[float, ...]:
        n = max(self.pixels, 1)
        return tuple(math.sqrt(max(q / n - (s / n) ** 2, 0.0)) for s, q in zip(self.sum, self.sumsq))

    def __add__(self, other: Stats) -> Stats:
        return Stats(
            self.pixels + other.pixels,
            tuple(a + b for a, b in zip(self.sum, other.sum)),
            tuple(a + b for a, b in zip(self.sumsq, other.sumsq)),
        )

    @staticmethod
    def zero() -> Stats:
        return Stats(0, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


@dataclass(frozen=True)
class Components:
    """Extensions of the parts of each sample inside a shard."""

    image: str = "jpg"
    label: str = "cls"  # ASCII decimal, the webdataset convention
    label_bin: str | None = "lbl"  # int32 little-endian, for DALI's reader; None for foreign shards
    meta: str | None = "json"


@dataclass(frozen=True)
class Manifest:
    classes: tuple[str, ...]
    splits: dict[str, SplitInfo]
    stats: Stats
    settings: dict = field(default_factory=dict)
    components: Components = Components()
    root: Path = Path(".")  # the folder holding dataset.json; not serialised

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def mean(self) -> tuple[float, ...]:
        return self.stats.mean

    @property
    def std(self) -> tuple[float, ...]:
        return self.stats.std

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits or not self.splits[name].shards:
            have = sorted(k for k, v in self.splits.items() if v.shards)
            raise ManifestError(f"{self.root}: no '{name}' split (this data set has: {', '.join(have)})")
        return self.splits[name]

    def shard_paths(self, split: str) -> list[str]:
        return [str(self.root / s.path) for s in self.split(split).shards]

    def class_weights(self, split: str = "train") -> tuple[float, ...]:
        """Balanced weights, n / (k * n_c): the mean weight per sample is 1 (sklearn's "balanced")."""
        counts = self.splits[split].class_counts if split in self.splits else ()
        total, k = sum(counts), len(counts)
        return tuple(total / (k * c) if c else 0.0 for c in counts)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "classes": list(self.classes),
            "components": asdict(self.components),
            "splits": {
                name: {
                    "samples": sp.samples,
                    "class_counts": list(sp.class_counts),
                    "shards": [asdict(s) for s in sp.shards],
                }
                for name, sp in self.splits.items()
            },
            "mean": list(self.mean),
            "std": list(self.std),
            "class_weights": list(self.class_weights()),
            "stats": asdict(self.stats),
            "settings": self.settings,
        }


def write_json_atomic(path: Path, data) -> None:
    """Write JSON under a temporary name and rename, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def save(manifest: Manifest, folder: Path | None = None) -> Path:
    path = Path(folder or manifest.root) / MANIFEST_NAME
    write_json_atomic(path, manifest.to_dict())
    return path


def from_dict(d: dict, root: Path) -> Manifest:
    if d.get("format") != FORMAT:
        raise ManifestError(f"{root}: not a fastpipe dataset.json (format={d.get('format')!r})")
    if d.get("version", 0) > VERSION:
        raise ManifestError(f"{root}: dataset.json version {d['version']} is newer than this fastpipe "
                            f"understands ({VERSION}): upgrade fastpipe")
    splits = {
        name: SplitInfo(
            shards=tuple(ShardInfo(**s) for s in sp["shards"]),
            class_counts=tuple(sp["class_counts"]),
        )
        for name, sp in d["splits"].items()
    }
    st = d["stats"]
    return Manifest(
        classes=tuple(d["classes"]),
        splits=splits,
        stats=Stats(st["pixels"], tuple(st["sum"]), tuple(st["sumsq"])),
        settings=d.get("settings", {}),
        components=Components(**d.get("components", {})),
        root=Path(root),
    )


def load(folder: str | os.PathLike) -> Manifest:
    """Read OUT/dataset.json (or a path to the file itself) with errors that say what to do."""
    path = Path(folder)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.exists():
        raise ManifestError(f"{path} not found: run `fastpipe shard SRC {path.parent}` first, "
                            f"or `fastpipe index SHARDS...` for shards written by another tool")
    try:
        data = json.loads(path.read_text())
        return from_dict(data, path.parent)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ManifestError(f"{path} is damaged ({type(e).__name__}: {e}); re-run the conversion") from e

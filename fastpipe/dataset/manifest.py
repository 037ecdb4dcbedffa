"""The `dataset.json` schema: the one place that reads, writes and validates it.

Everything a later stage needs (classes, counts, shard list, mean/std, class weights) is computed once at
conversion and read from here; nothing re-scans the shards at training time.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastpipe.errors import ConfigError, DataError
from fastpipe.store.urls import check_relative
from fastpipe.util import write_json_atomic

FORMAT = "fastpipe-dataset"
VERSION = 1
MANIFEST_NAME = "dataset.json"


class ManifestError(DataError):
    """dataset.json is missing, unreadable, or does not describe the shards next to it."""


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the manifest's folder, inside it
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
    # Files written beside the shards, by kind: {"previews": {class: file}, "rejected": file, "readers": [file]}.
    # With the shard list, this is what fastpipe owns in the folder (and the only thing `--overwrite` removes).
    outputs: dict = field(default_factory=dict)
    # "single": one class per image; "multilabel": a set of labels per image (class_counts then count positives)
    task: str = "single"
    # What reads the data set's files (a store.location: a local Folder, a store folder with this node's cache, an
    # Overlay), attached by dataset/loading.py; None for a manifest built in memory (its files are under `root`).
    # For a data set in a store, `root` is the node's cache folder. Not serialised, never printed (credentials).
    files: object = field(default=None, repr=False, compare=False)

    @property
    def location(self) -> str:
        """Where the data set is, for messages and records: its URL, or its folder."""
        return str(self.root) if self.files is None else self.files.url

    @property
    def multilabel(self) -> bool:
        return self.task == "multilabel"

    @property
    def foreign(self) -> bool:
        """Shards adopted with `fastpipe index`: the tars are the user's, only the .idx files are ours."""
        return "indexed_from" in self.settings

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
            raise ManifestError(f"{self.location}: no '{name}' split (this data set has: {', '.join(have)})")
        return self.splits[name]

    def shard_paths(self, split: str) -> list[str]:
        return [str(self.root / s.path) for s in self.split(split).shards]

    def class_weights(self, split: str = "train") -> tuple[float, ...]:
        """Balanced weights, n / (k * n_c): the mean weight per sample is 1 (sklearn's "balanced"). Multi-label:
        n_c counts the images with label c, n the images."""
        sp = self.splits.get(split)
        counts = sp.class_counts if sp else ()
        total, k = (sp.samples if sp and self.multilabel else sum(counts)), len(counts)
        return tuple(total / (k * c) if c else 0.0 for c in counts)

    def pos_weight(self, split: str = "train") -> tuple[float, ...]:
        """Multi-label: negatives / positives per class, BCEWithLogitsLoss's pos_weight (0 for a class never seen)."""
        sp = self.splits.get(split)
        if not sp:
            return ()
        return tuple((sp.samples - c) / c if c else 0.0 for c in sp.class_counts)

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
            "task": self.task,
            **({"pos_weight": list(self.pos_weight())} if self.multilabel else {}),
            "stats": asdict(self.stats),
            "settings": self.settings,
            "outputs": self.outputs,
        }


def save(manifest: Manifest, folder: Path | None = None) -> Path:
    path = Path(folder or manifest.root) / MANIFEST_NAME
    write_json_atomic(path, manifest.to_dict())
    return path


def from_dict(d: dict, root: Path, where: str | None = None) -> Manifest:
    """Build a Manifest from parsed JSON, checking every field on the way (see _Check): one clear ManifestError
    for a wrong type, a range, a path outside the folder or a count that does not add up. `where` names the data
    set in messages (its URL when it came from a store; `root` is then the local cache)."""
    where = where or str(root)
    c = _Check(where)
    c.expect(isinstance(d, dict), "", "a JSON object")
    if d.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a fastpipe dataset.json (format={d.get('format')!r})")
    if not isinstance(d.get("version", 0), int) or d.get("version", 0) > VERSION:
        raise ManifestError(f"{where}: dataset.json version {d.get('version')!r} is newer than this fastpipe "
                            f"understands ({VERSION}): upgrade fastpipe")
    classes = c.strings(d.get("classes"), "classes")
    c.expect(len(set(classes)) == len(classes) and classes, "classes", "a non-empty list of distinct names")
    comp = d.get("components", {})
    c.expect(isinstance(comp, dict) and all(v is None or (isinstance(v, str) and _EXT.fullmatch(v))
                                            for v in comp.values()), "components", "file extensions")
    splits_raw = d.get("splits")
    c.expect(isinstance(splits_raw, dict) and set(splits_raw) <= {"train", "val"}, "splits",
             "an object with 'train' and/or 'val'")
    task = d.get("task", "single")
    c.expect(task in ("single", "multilabel"), "task", "'single' or 'multilabel'", task)
    splits = {name: c.split(sp, f"splits.{name}", len(classes), task) for name, sp in splits_raw.items()}
    paths = [s.path for sp in splits.values() for s in sp.shards]
    dup = sorted({p for p in paths if paths.count(p) > 1})
    c.expect(not dup, "splits", f"each shard listed once (listed twice: {dup[:3]})")
    stats = c.stats(d.get("stats"), splits, d)
    settings = d.get("settings", {})
    c.expect(isinstance(settings, dict), "settings", "an object")
    try:
        components = Components(**comp)
    except TypeError as e:
        raise ManifestError(f"{where}/{MANIFEST_NAME}: components: {e}") from None
    return Manifest(tuple(classes), splits, stats, settings, components, Path(root), c.outputs(d.get("outputs", {})),
                    task)


_EXT = re.compile(r"[A-Za-z0-9_.;-]{1,32}")
_SHA = re.compile(r"[0-9a-f]{64}")


class _Check:
    """Field checks for from_dict; each failure names the field, what it holds and what is expected."""

    def __init__(self, where: str):
        self.file = f"{where.rstrip('/')}/{MANIFEST_NAME}"

    def expect(self, ok, where: str, expected: str, got=None) -> None:
        if not ok:
            held = f" (holds {str(got)[:60]!r})" if got is not None else ""
            raise ManifestError(f"{self.file}: {where or 'the file'} should be {expected}{held}; "
                                f"re-run the conversion (`fastpipe shard` or `fastpipe index`) to rewrite it")

    def integer(self, v, where: str, low: int = 0) -> int:
        self.expect(isinstance(v, int) and not isinstance(v, bool) and v >= low, where, f"an integer >= {low}", v)
        return v

    def strings(self, v, where: str) -> list[str]:
        self.expect(isinstance(v, list) and all(isinstance(x, str) and x for x in v), where,
                    "a list of non-empty strings", v)
        return v

    def inside(self, v, where: str) -> str:
        """A relative path inside the manifest's folder, as every store will request it (urls.check_relative)."""
        try:
            return check_relative(v, where)
        except ConfigError as e:
            raise ManifestError(f"{self.file}: {e}; a dataset.json lists only files inside the data set's folder. "
                                f"Re-run the conversion, or do not use a data set from this source") from None

    def shard(self, s, where: str) -> ShardInfo:
        self.expect(isinstance(s, dict), where, "an object", s)
        self.expect(isinstance(s.get("sha256"), str) and _SHA.fullmatch(s["sha256"]), f"{where}.sha256",
                    "a sha256 hex digest", s.get("sha256"))
        return ShardInfo(self.inside(s.get("path"), f"{where}.path"),
                         self.integer(s.get("samples"), f"{where}.samples"),
                         self.integer(s.get("bytes"), f"{where}.bytes", 1024), s["sha256"],
                         self.inside(s.get("index"), f"{where}.index"))

    def split(self, sp, where: str, k: int, task: str = "single") -> SplitInfo:
        self.expect(isinstance(sp, dict) and isinstance(sp.get("shards"), list), where, "an object with shards", sp)
        shards = tuple(self.shard(s, f"{where}.shards[{i}]") for i, s in enumerate(sp["shards"]))
        counts = sp.get("class_counts")
        self.expect(isinstance(counts, list) and len(counts) == k, f"{where}.class_counts",
                    f"a list of {k} counts (one per class)", counts)
        counts = [self.integer(x, f"{where}.class_counts[{i}]") for i, x in enumerate(counts)]
        total = sum(s.samples for s in shards)
        if task == "multilabel":  # positives per class: each at most the images
            self.expect(max(counts, default=0) <= total, f"{where}.class_counts",
                        f"positive counts of at most the shards' {total} samples", max(counts, default=0))
        else:
            self.expect(sum(counts) == total, f"{where}.class_counts",
                        f"counts adding up to the shards' {total} samples", sum(counts))
        return SplitInfo(shards, tuple(counts))

    def outputs(self, out) -> dict:
        """Every file name outputs lists, checked to be inside the data set's folder."""
        self.expect(isinstance(out, dict), "outputs", "an object", out)
        near = out.get("near_duplicates", {"file": "near-duplicates.jsonl"})
        self.expect(isinstance(near, dict) and "file" in near, "outputs.near_duplicates", "an object with a file",
                    near)
        for key, names in (("previews", out.get("previews", {})), ("readers", out.get("readers", [])),
                           ("near_duplicates", {k: near[k] for k in ("file", "preview", "fingerprints") if k in near}),
                           ("rejected", {"": out["rejected"]} if "rejected" in out else {})):
            self.expect(isinstance(names, (dict, list)), f"outputs.{key}", "file names", names)
            for k, v in (names.items() if isinstance(names, dict) else enumerate(names)):
                self.inside(v, f"outputs.{key}[{k!r}]")
        return out

    def stats(self, st, splits: dict[str, SplitInfo], d: dict) -> Stats:
        """stats, and the mean/std written from them: a hand edit of either is refused, not silently ignored."""
        self.expect(isinstance(st, dict), "stats", "an object with pixels, sum and sumsq", st)
        pixels = self.integer(st.get("pixels"), "stats.pixels")
        train = splits.get("train")
        self.expect(pixels > 0 or not train or not train.samples, "stats.pixels",
                    "above 0 when there are train samples (mean/std come from them)", pixels)
        vecs = []
        for name in ("sum", "sumsq"):
            v = st.get(name)
            self.expect(isinstance(v, list) and len(v) == 3 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in v),
                f"stats.{name}", "three finite non-negative numbers", v)
            vecs.append(tuple(float(x) for x in v))
        stats = Stats(pixels, vecs[0], vecs[1])
        for name, derived in (("mean", stats.mean), ("std", stats.std)):  # written for readers; stats is the source
            given, shown = d.get(name, list(derived)), ", ".join(f"{v:.4f}" for v in derived)
            self.expect(isinstance(given, list) and len(given) == 3 and all(
                isinstance(x, (int, float)) and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)
                for x, y in zip(given, derived)), name, f"what its stats give ({shown}): a hand edit of mean/std is "
                f"not used (fastpipe normalises with the stored train images' statistics; for others: --normalize "
                f"imagenet or M1,M2,M3:S1,S2,S3 in train and bench, normalize= in make_loader)", given)
        return stats

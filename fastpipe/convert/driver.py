"""`fastpipe shard`: the parallel conversion driver.

Workers decode/resize/encode; the main process writes shards in plan order (an ordered `imap`), so output
is deterministic whatever the worker count. See plan.py for the plan, journal.py for resuming.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastpipe import __version__
from fastpipe.convert import images, plan, previews
from fastpipe.convert.journal import Journal, SplitProgress
from fastpipe.convert.sources import Rejection, discover
from fastpipe.convert.writer import ShardWriter
from fastpipe.loaders.workers import usable_cores
from fastpipe.manifest import Components, Manifest, SplitInfo, Stats, write_json_atomic

SPLITS = ("train", "val")


class ConvertError(RuntimeError):
    """A conversion that can't start: bad arguments, or an OUT that holds other work."""


@dataclass(frozen=True)
class ShardConfig:
    src: Path
    out: Path
    short_side: int = 320
    quality: int = 90
    val_fraction: float = 0.1
    seed: int = 0
    max_shard_size: int = 256 * 1024**2
    max_pixels: int = 200_000_000
    workers: int = 0  # 0 = every core
    overwrite: bool = False
    part: int = 0
    parts: int = 1

    def settings(self) -> dict:
        """Everything that changes the output bytes (workers and overwrite don't)."""
        return {"source": str(Path(self.src).resolve()), "short_side": self.short_side,
                "quality": self.quality, "val_fraction": self.val_fraction, "seed": self.seed,
                "max_shard_size": self.max_shard_size, "max_pixels": self.max_pixels,
                "part": self.part, "parts": self.parts}

    def image_settings(self) -> images.ImageSettings:
        return images.ImageSettings(self.short_side, self.quality, self.max_pixels)

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConvertError(f"--val-fraction {self.val_fraction}: must be in [0, 1)")
        if not 1 <= self.quality <= 100:
            raise ConvertError(f"--quality {self.quality}: must be 1..100")
        if self.short_side < 8:
            raise ConvertError(f"--short-side {self.short_side}: must be at least 8 pixels")
        if not 0 <= self.part < self.parts:
            raise ConvertError(f"--part {self.part} --parts {self.parts}: need 0 <= part < parts")
        if self.max_shard_size < 64 * 1024:
            raise ConvertError(f"--max-shard-size {self.max_shard_size}: use at least 64KB")

    @property
    def suffix(self) -> str:
        return "" if self.parts == 1 else f".part-{self.part:03d}-of-{self.parts:03d}"


@dataclass
class Summary:
    out: Path
    discovered: int = 0
    written: dict[str, int] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    converted_now: int = 0
    up_to_date: bool = False
    phases: dict[str, float] = field(default_factory=dict)  # seconds: start (pool), hash, convert, finish

    def lines(self) -> list[str]:
        rate = self.converted_now / self.seconds if self.seconds else 0.0
        out = [f"discovered {self.discovered} files -> written "
               + ", ".join(f"{k} {v}" for k, v in self.written.items())
               + f", rejected {sum(self.rejected.values())}"]
        out += [f"  rejected {n:>5}  {reason}" for reason, n in sorted(self.rejected.items())]
        if self.up_to_date:
            out.append(f"{self.out} is already complete for these settings: nothing to do")
        else:
            out.append(f"{self.converted_now} images converted in {self.seconds:.1f} s ({rate:.1f} img/s)")
        return out


# -- worker side -------------------------------------------------------------------------------------
_SETTINGS: images.ImageSettings | None = None


def _init_worker(settings: images.ImageSettings) -> None:
    global _SETTINGS
    _SETTINGS = settings


def _convert_one(path: str) -> images.Encoded | images.Rejected:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return images.Rejected("unreadable", f"{type(e).__name__}: {e.strerror or e}")
    return images.process(data, _SETTINGS)


# -- main side ---------------------------------------------------------------------------------------
def _sample_parts(enc: images.Encoded, sample: plan.Sample, classes) -> dict[str, bytes]:
    meta = {"path": sample.path, "class": classes[sample.label], "label": sample.label,
            "orig_size": list(enc.orig_size), "size": list(enc.size)}
    return {"jpg": enc.jpeg, "cls": str(sample.label).encode(),
            "lbl": np.int32(sample.label).tobytes(), "json": json.dumps(meta, sort_keys=True).encode()}


class _SplitRun:
    """Writes one split's samples, journaling each shard with the samples, stats and rejections it closes."""

    def __init__(self, split, samples, cfg, journal, progress: SplitProgress, num_classes):
        self.split, self.samples, self.journal = split, samples, journal
        self.progress = progress
        if not progress.counts:
            progress.counts = [0] * num_classes
        self._reset_pending(num_classes)
        prefix = split if cfg.parts == 1 else f"{split}-{cfg.part:03d}"
        self.writer = ShardWriter(cfg.out, prefix, cfg.max_shard_size, len(progress.shards), self._closed)
        self.pos = progress.end

    def _reset_pending(self, k):
        self.stats, self.counts, self.rejected = Stats.zero(), [0] * k, []

    def _closed(self, shard, done=False):
        entry = {"split": self.split, "shard": asdict(shard) if shard else None, "end": self.pos,
                 "stats": asdict(self.stats), "counts": self.counts, "rejected": self.rejected, "done": done}
        self.journal.append(entry)
        self.progress.add(entry)
        self._reset_pending(len(self.counts))

    def add(self, result, classes) -> None:
        sample = self.samples[self.pos]
        if isinstance(result, images.Rejected):
            self.rejected.append({"path": sample.path, "reason": result.reason, "detail": result.detail})
        else:
            self.writer.write(f"{sample.pos:08d}", _sample_parts(result, sample, classes))
            self.stats = self.stats + Stats(result.size[0] * result.size[1], result.pixel_sum,
                                            result.pixel_sumsq)
            self.counts[sample.label] += 1
        self.pos += 1

    def finish(self) -> None:
        self.pos = len(self.samples)
        self.writer.finish()  # journals the last shard through the callback
        self._closed(None, done=True)  # rejections after it, and the mark that the split is complete


def _make_pool(workers: int, settings: images.ImageSettings):
    # spawn, not fork: a parent that already holds torch/CUDA state must not be forked.
    return get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(settings,))


def _known_outputs(out: Path) -> list[Path]:
    pats = ["*.tar", "*.idx", "*.tar.tmp", "*.idx.tmp", "dataset*.json", "rejected*.jsonl", ".fastpipe-progress*"]
    return [p for pat in pats for p in out.glob(pat)] + [out / "previews"]


def _guard(cfg: ShardConfig, fingerprint: str, journal: Journal) -> bool:
    """True when OUT already holds this exact conversion. Refuses other work unless --overwrite."""
    manifest_path = cfg.out / f"dataset{cfg.suffix}.json"
    previous = None
    if manifest_path.exists():
        try:
            previous = json.loads(manifest_path.read_text())["settings"].get("fingerprint")
        except (ValueError, KeyError):
            previous = "unreadable"
    elif journal.path.exists():
        previous = journal.read_fingerprint()
    if previous is None or previous == fingerprint:
        return previous == fingerprint and manifest_path.exists()
    if not cfg.overwrite:
        raise ConvertError(f"{cfg.out} holds a conversion made with other settings or other input files. "
                           f"Use --overwrite to replace it, or choose another OUT folder.")
    for p in _known_outputs(cfg.out):
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return False


def _convert_split(name, samples, root: Path, run: _SplitRun, classes, pool) -> int:
    todo = samples[run.pos:]
    paths = [str(root / s.path) for s in todo]
    results = pool.imap(_convert_one, paths, chunksize=2) if pool else map(_convert_one, paths)
    try:
        for result in tqdm(results, total=len(todo), desc=f"converting {name}", unit="img", mininterval=0.5):
            run.add(result, classes)
    except BaseException:
        run.writer.abort()  # no half shard under a final name; the journal keeps the finished ones
        raise
    run.finish()
    return len(todo)


def write_rejected(path: Path, rejected: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rejected))
    tmp.replace(path)


def _finalize(cfg, classes, progress, early: list[Rejection], fingerprint) -> Manifest:
    rejected = [r.to_dict() for r in early] + [r for p in progress.values() for r in p.rejected]
    rejected.sort(key=lambda r: (r["path"], r["reason"]))
    write_rejected(cfg.out / f"rejected{cfg.suffix}.jsonl", rejected)
    manifest = Manifest(
        classes=tuple(classes),
        splits={n: SplitInfo(tuple(p.shards), tuple(p.counts)) for n, p in progress.items()},
        stats=progress["train"].stats,
        settings={**cfg.settings(), "fingerprint": fingerprint, "fastpipe": __version__},
        components=Components(),
        root=cfg.out,
    )
    write_json_atomic(cfg.out / f"dataset{cfg.suffix}.json", manifest.to_dict())
    if cfg.parts == 1:  # a cluster job's previews are drawn at merge time, from all parts
        previews.contact_sheets(manifest, cfg.out / "previews", seed=cfg.seed)
    return manifest


def _summarise(summary: Summary, manifest_path: Path, rejected_path: Path) -> Summary:
    data = json.loads(manifest_path.read_text())
    summary.written = {n: sp["samples"] for n, sp in data["splits"].items()}
    if rejected_path.exists():
        summary.rejected = Counter(json.loads(line)["reason"] for line in rejected_path.read_text().splitlines())
    return summary


class _Clock:
    def __init__(self, laps: dict[str, float], start: float):
        self.laps, self.last = laps, start

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now


def shard(cfg: ShardConfig) -> Summary:
    """Convert cfg.src into shards under cfg.out (resuming, skipping or refusing as the folder requires)."""
    cfg.validate()
    start = time.perf_counter()
    source = discover(cfg.src)
    cfg.out.mkdir(parents=True, exist_ok=True)
    summary = Summary(cfg.out, discovered=len(source.items) + len(source.rejections))
    workers = cfg.workers or usable_cores()
    pool = _make_pool(workers, cfg.image_settings()) if workers > 1 else None
    _init_worker(cfg.image_settings())
    clock = _Clock(summary.phases, start)
    try:
        clock.lap("start")
        hashes, early = plan.hash_files(source, workers)
        clock.lap("hash")
        items, duplicates = plan.deduplicate(list(source.items), hashes)
        by_split = plan.split_items(items, cfg.val_fraction, cfg.seed)
        ordered = {n: plan.order_split(by_split[n], source.classes, cfg.seed, salt)
                   for salt, n in enumerate(SPLITS)}
        mine = {n: [s[i] for i in plan.part_range(len(s), cfg.part, cfg.parts)] for n, s in ordered.items()}
        fingerprint = plan.plan_fingerprint(cfg.settings(), mine, hashes)
        journal = Journal(cfg.out / f".fastpipe-progress{cfg.suffix}.jsonl", fingerprint)
        if not _guard(cfg, fingerprint, journal):
            progress = journal.load(cfg.out)
            for name in SPLITS:
                p = progress.setdefault(name, SplitProgress())
                if not p.done:
                    run = _SplitRun(name, mine[name], cfg, journal, p, len(source.classes))
                    summary.converted_now += _convert_split(name, mine[name], source.root, run,
                                                            source.classes, pool)
            clock.lap("convert")
            # Refusals found before any decoding are recorded once, by part 0, for a cluster job.
            early_all = list(source.rejections) + early + duplicates if cfg.part == 0 else []
            _finalize(cfg, source.classes, progress, early_all, fingerprint)
            journal.remove()
            clock.lap("finish")
        else:
            summary.up_to_date = True
    finally:
        if pool is not None:
            pool.terminate()
    summary.seconds = time.perf_counter() - start
    return _summarise(summary, cfg.out / f"dataset{cfg.suffix}.json", cfg.out / f"rejected{cfg.suffix}.jsonl")

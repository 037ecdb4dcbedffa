"""`fastpipe shard`: the parallel conversion driver.

Workers read, decode, resize and encode the photos (photos.py; local processes: workers.py, or Ray tasks across a
cluster: onray.py); this process alone writes the shards, in plan order (an ordered `imap`), so the output is the
same bytes whatever does the work. discovery.py: what SRC holds, plan.py: the plan, journal.py: resuming,
outputs.py: what a run may write, publish.py: OUT in a store.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from fastpipe import __version__
from fastpipe.convert import images, outputs, photos, plan, previews, publish
from fastpipe.convert.discovery import discover
from fastpipe.convert.journal import Journal, SplitProgress, journal_name
from fastpipe.convert.sources import Rejection
from fastpipe.convert.summary import Summary, summarise
from fastpipe.convert.workers import Workers
from fastpipe.convert.writer import ShardWriter
from fastpipe.errors import ConfigError, MissingDependency
from fastpipe.manifest import Components, Manifest, SplitInfo, Stats
from fastpipe.options import SEED_MAX, check, opt, parse_procs, parse_size
from fastpipe.shardformat import encode_label
from fastpipe.storage import is_url
from fastpipe.urls import check_location
from fastpipe.util import FolderLock, local_path, usable_cores, write_json_atomic, write_jsonl_atomic

SPLITS = ("train", "val")


class ConvertError(ConfigError):
    """A conversion that can't start: bad arguments, or an OUT that holds other work."""


@dataclass(frozen=True)
class ShardConfig:
    src: Path | str = opt(None, "folder of class folders (optionally train/ and val/), a CSV/TXT list, or either in "
                                "a store (s3://bucket/photos, gs://, az://; https://.../list.csv)", positional=True)
    out: Path = opt(None, "output folder, or a URL to upload to (s3://bucket/prefix, gs://, az://)", positional=True)
    short_side: int = opt(320, "stored shorter side in pixels, never upscaled", low=8, high=65535)
    quality: int = opt(90, "JPEG quality of the stored images", low=1, high=100)
    val_fraction: float = opt(0.1, "stratified validation share (ignored when SRC has train/ and val/ folders)",
                              low=0, below=1)
    seed: int = opt(0, "seed for split and shuffle", low=0, high=SEED_MAX)
    max_shard_size: int = opt(256 * 1024**2, "shard size limit, e.g. 256MB, 64MB", parse=parse_size, low=64 * 1024,
                               high=1024**4)
    max_pixels: int = opt(200_000_000, "refuse larger images (decompression-bomb guard)", low=1)
    max_file_size: int = opt(1024**3, "refuse larger files, e.g. 1GB", parse=parse_size, low=1)
    workers: int | None = opt(None, "processes: a number (0 = in this process) or auto (every core)",
                              parse=parse_procs, low=0, high=1024)
    overwrite: bool = opt(False, "replace a conversion made with other settings (removes only files fastpipe "
                                 "wrote)")
    part: int = opt(0, "this part's number, for cluster array jobs", low=0)
    parts: int = opt(1, "number of independent parts (then: fastpipe merge)", low=1, high=100_000)
    ray: bool = opt(False, "read, decode, resize and encode the photos as tasks on a Ray cluster ($RAY_ADDRESS or "
                           "--ray-address; else a local one of --workers CPUs); needs fastpipe[ray]")
    ray_address: str | None = opt(None, "the Ray cluster to join: its head node, e.g. 10.0.0.1:6379; implies --ray")

    def settings(self) -> dict:
        """Everything that changes the output bytes (workers, overwrite and Ray don't)."""
        source = self.src if is_url(self.src) else str(Path(self.src).resolve())
        return {"source": source, "short_side": self.short_side,
                "quality": self.quality, "val_fraction": self.val_fraction, "seed": self.seed,
                "max_shard_size": self.max_shard_size, "max_pixels": self.max_pixels,
                "part": self.part, "parts": self.parts}

    def image_settings(self) -> images.ImageSettings:
        return images.ImageSettings(self.short_side, self.quality, self.max_pixels)

    def __post_init__(self):
        # Paths given as text (the API, the CLI) become Paths; a URL is checked here, before anything is created.
        object.__setattr__(self, "src", check_location(self.src, "SRC") if is_url(self.src) else
                           local_path(self.src, "SRC"))
        object.__setattr__(self, "out", check_location(self.out, "OUT") if is_url(self.out) else
                           local_path(self.out, "OUT"))
        check(self)

    def validate(self) -> None:
        """What one setting's range cannot say (each setting's own range is checked when the config is built)."""
        if not self.part < self.parts:
            raise ConvertError(f"--part {self.part} --parts {self.parts}: need 0 <= part < parts")
        if self.uses_ray and importlib.util.find_spec("ray") is None:
            raise MissingDependency("--ray needs Ray here and on every node of the cluster: pip install "
                                    "'fastpipe[ray]' (or pip install ray)")

    @property
    def uses_ray(self) -> bool:
        return self.ray or self.ray_address is not None

    @property
    def suffix(self) -> str:
        return "" if self.parts == 1 else f".part-{self.part:03d}-of-{self.parts:03d}"

    @property
    def prefixes(self) -> list[str]:
        return [n if self.parts == 1 else f"{n}-{self.part:03d}" for n in SPLITS]


# -- main side ---------------------------------------------------------------------------------------
def _sample_parts(enc: images.Encoded, sample: plan.Sample, classes) -> dict[str, bytes]:
    if isinstance(sample.label, tuple):
        named = {"classes": [classes[k] for k in sample.label], "labels": list(sample.label)}
    else:
        named = {"class": classes[sample.label], "label": sample.label}
    meta = {"path": sample.path, **named, "orig_size": list(enc.orig_size), "size": list(enc.size)}
    return {"jpg": enc.jpeg, **encode_label(sample.label, len(classes)),
            "json": json.dumps(meta, sort_keys=True).encode()}


class _SplitRun:
    """Writes one split's samples, journaling each shard with the samples, stats and rejections it closes."""

    def __init__(self, split, samples, cfg, journal, progress: SplitProgress, num_classes):
        self.split, self.samples, self.journal = split, samples, journal
        self.progress = progress
        if not progress.counts:
            progress.counts = [0] * num_classes
        self._reset_pending(num_classes)
        prefix = cfg.prefixes[SPLITS.index(split)]
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

    def add(self, result, classes, summary: Summary) -> None:
        sample = self.samples[self.pos]
        if isinstance(result, images.Rejected):
            self.rejected.append({"path": sample.path, "reason": result.reason, "detail": result.detail})
        else:
            summary.written_now += 1
            if result.mode != "RGB":
                summary.modes[result.mode] += 1
            self.writer.write(f"{sample.pos:08d}", _sample_parts(result, sample, classes))
            self.stats = self.stats + Stats(result.size[0] * result.size[1], result.pixel_sum, result.pixel_sumsq)
            for k in sample.label if isinstance(sample.label, tuple) else (sample.label,):
                self.counts[k] += 1  # multi-label: positives per class
        self.pos += 1

    def finish(self) -> None:
        self.pos = len(self.samples)
        self.writer.finish()  # journals the last shard through the callback
        self._closed(None, done=True)  # rejections after it, and the mark that the split is complete


def _make_pool(cfg: ShardConfig, source, workers: int, initargs: tuple):
    """The processes that read and convert the photos: Ray tasks (onray.py, where Ray is imported), local worker
    processes, or none (this process)."""
    if cfg.uses_ray:
        from fastpipe.convert.onray import RayWorkers

        settings, limit, remote, root = initargs  # each node reads the store with credentials of its own
        return RayWorkers(cfg.ray_address, cfg.workers, photos.init_worker,
                          (settings, limit, remote and remote.without_credentials(), root))
    return Workers(workers, photos.init_worker, initargs) if workers > 1 else None


def _guard(cfg: ShardConfig, fingerprints: tuple[str, str], journal: Journal) -> bool:
    """True when OUT already holds this exact conversion (plan.fingerprints). Refuses other work unless
    --overwrite, and then removes only what fastpipe's own records say it wrote (outputs.py)."""
    manifest, problem = outputs.read_manifest(cfg.out / f"dataset{cfg.suffix}.json")
    if manifest is not None:
        previous = manifest.settings.get("fingerprint") or "adopted shards (fastpipe index)"
    else:
        previous = problem or journal.read_fingerprint()
    owned = (outputs.manifest_files(manifest) if manifest else set()) | outputs.journal_files(journal.path)
    if previous not in (None, *fingerprints):
        if not cfg.overwrite:
            what = previous if not _is_hex(previous) else "a conversion made with other settings or input files"
            raise ConvertError(f"{cfg.out} holds {what}. Use --overwrite to replace it (only files fastpipe "
                               f"wrote are removed), or choose another OUT folder.")
        outputs.remove(owned | outputs.temporary_files(cfg.out, cfg.prefixes) | {journal.path,
                       cfg.out / f"dataset{cfg.suffix}.json"})
        owned = set()
    outputs.refuse_conflicts(cfg.out, outputs.foreign_conflicts(cfg.out, cfg.prefixes, owned))
    return previous in fingerprints and manifest is not None


def _is_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _convert(runs: list[_SplitRun], source, pixels: dict[str, int], pool, summary: Summary) -> None:
    """Every split still to do, under one progress bar (with a Ray pool: its nodes busy and tasks retried)."""
    with tqdm(total=sum(len(r.samples) - r.pos for r in runs), desc="converting", unit="img",
              mininterval=0.5) as bar:
        for run in runs:
            summary.converted_now += _convert_split(run, source, pixels, pool, bar, summary)


def _convert_split(run: _SplitRun, source, pixels: dict[str, int], pool, bar, summary: Summary) -> int:
    todo = run.samples[run.pos:]
    where = [photos.location(source.root, s.path) for s in todo]
    # 4 a task: fewer messages per image; more would leave one worker idle longer at the end
    results = pool.imap(photos.convert_one, where, chunksize=4, pixels=[pixels.get(s.path, 0) for s in todo]) \
        if pool else map(photos.convert_one, where)
    try:
        for result in results:
            run.add(result, source.classes, summary)
            bar.update()
            if pool is not None:
                bar.set_postfix_str(pool.status(), refresh=False)
    except BaseException:
        run.writer.abort()  # no half shard under a final name; the journal keeps the finished ones
        raise
    run.finish()
    return len(todo)


def _finalize(cfg, source, progress, early: list[Rejection], ids: dict, pool) -> Manifest:
    """rejected.jsonl, previews, then dataset.json last: a conversion is complete only when every output is, so
    a run stopped in between (a full disk while drawing previews) is finished by the rerun, not declared done."""
    rejected = sorted([r.to_dict() for r in early] + [r for p in progress.values() for r in p.rejected],
                      key=lambda r: (r["path"], r["reason"]))
    write_jsonl_atomic(cfg.out / f"rejected{cfg.suffix}.jsonl", rejected)
    manifest = Manifest(
        classes=tuple(source.classes),
        splits={n: SplitInfo(tuple(p.shards), tuple(p.counts)) for n, p in progress.items()},
        stats=progress["train"].stats,
        settings={**cfg.settings(), **ids, "fastpipe": __version__},  # ids: plan.fingerprints
        components=Components(label="labels") if source.multilabel else Components(),
        root=cfg.out,
        outputs={"rejected": f"rejected{cfg.suffix}.jsonl"},
        task="multilabel" if source.multilabel else "single",
    )
    if cfg.parts == 1:
        names = previews.contact_sheets(manifest, cfg.out / "previews", seed=cfg.seed, pool=pool)
        manifest.outputs["previews"] = {c: f"previews/{f}" for c, f in names.items()}
    else:  # a cluster job's previews are drawn at merge time, from every part's uniform sample of each class
        manifest.outputs["preview_candidates"] = previews.candidates(manifest, cfg.seed, cfg.part)
    write_json_atomic(cfg.out / f"dataset{cfg.suffix}.json", manifest.to_dict())
    return manifest


class _Clock:
    def __init__(self, laps: dict[str, float], start: float):
        self.laps, self.last = laps, start

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = now - self.last, now


def shard(cfg: ShardConfig) -> Summary:
    """Convert cfg.src into shards under cfg.out (resuming, skipping or refusing as needed; a URL: publish.py)."""
    cfg.validate()
    start = time.perf_counter()
    source = discover(cfg.src, exclude=cfg.out, limit=cfg.max_file_size)
    if is_url(cfg.out):
        return publish.shard_to_url(cfg, lambda staged: _shard_into(staged, source, start))
    return _shard_into(cfg, source, start)


def _shard_into(cfg: ShardConfig, source, start: float) -> Summary:
    cfg.out.mkdir(parents=True, exist_ok=True)
    summary = Summary(cfg.out, discovered=len(source.items) + len(source.rejections), ignored=source.ignored,
                      notes=list(source.notes))
    with FolderLock(cfg.out, f"fastpipe shard {cfg.src} {cfg.out}"):
        _run(cfg, source, summary, start)
    summary.seconds = time.perf_counter() - start
    return summarise(summary, cfg.out / f"dataset{cfg.suffix}.json", cfg.out / f"rejected{cfg.suffix}.jsonl")


def _plan(cfg: ShardConfig, source, workers: int, pool):
    """(this part's samples per split, the plan's fingerprints, early rejections, each photo's pixels)."""
    hashes, early, pixels = plan.hash_files(source, workers, pool if cfg.uses_ray else None)
    items, duplicates = plan.deduplicate(list(source.items), hashes)
    by_split = plan.split_items(items, cfg.val_fraction, cfg.seed, source.multilabel)
    ordered = {n: plan.order_split(by_split[n], source.classes, cfg.seed, salt, source.multilabel)
               for salt, n in enumerate(SPLITS)}
    mine = {n: [s[i] for i in plan.part_range(len(s), cfg.part, cfg.parts)] for n, s in ordered.items()}
    # Refusals found before any decoding are recorded once, by part 0, for a cluster job.
    early_all = list(source.rejections) + early + duplicates if cfg.part == 0 else []
    return mine, plan.fingerprints(cfg.settings(), ordered, mine, hashes), early_all, pixels


def _run(cfg: ShardConfig, source, summary: Summary, start: float) -> None:
    workers = usable_cores() if cfg.workers is None else cfg.workers
    initargs = (cfg.image_settings(), cfg.max_file_size, source.remote, None if source.remote else source.root)
    pool = _make_pool(cfg, source, workers, initargs)
    photos.init_worker(*initargs)  # this process converts too (no pool), and hashes
    clock = _Clock(summary.phases, start)
    try:
        clock.lap("start")
        mine, fingerprints, early, pixels = _plan(cfg, source, workers, pool)
        clock.lap("hash")
        journal = Journal(cfg.out / journal_name(cfg.suffix), fingerprints[0])
        if _guard(cfg, fingerprints[:2], journal):
            summary.up_to_date = True
            return
        progress = journal.load(cfg.out)
        runs = [_SplitRun(n, mine[n], cfg, journal, p, len(source.classes)) for n in SPLITS
                if not (p := progress.setdefault(n, SplitProgress())).done]
        _convert(runs, source, pixels, pool, summary)
        clock.lap("convert")
        _finalize(cfg, source, progress, early, {"fingerprint": fingerprints[0], "plan": fingerprints[2]}, pool)
        journal.remove()
        clock.lap("finish")
        summary.notes += pool.notes() if pool is not None else []
    finally:
        if pool is not None:
            pool.terminate()

"""`fastpipe shard`: the parallel conversion driver.

Workers read, decode, resize and encode the photos (photos.py; local processes: workers.py, or Ray tasks across a
cluster: onray.py); this process alone writes the shards, in plan order (an ordered `imap`), so the output is the
same bytes whatever does the work. config.py: the settings, discovery.py: what SRC holds, plan.py: the plan,
journal.py: resuming, outputs.py: what a run may write, readers.py: the files other readers need, publish.py: OUT
in a store.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from tqdm import tqdm

from fastpipe import __version__
from fastpipe.convert import images, nearplan, outputs, photos, plan, previews, publish, readers, spool
from fastpipe.convert.config import SPLITS, ConvertError, ShardConfig
from fastpipe.convert.discovery import discover
from fastpipe.convert.journal import Journal, SplitProgress, journal_name
from fastpipe.convert.sources import Rejection
from fastpipe.convert.summary import Summary, summarise
from fastpipe.convert.workers import Workers
from fastpipe.convert.writer import ShardWriter
from fastpipe.dataset import nearcopy
from fastpipe.dataset.manifest import Components, Manifest, SplitInfo, Stats
from fastpipe.dataset.shardformat import encode_label
from fastpipe.errors import DataError
from fastpipe.store.location import open_location
from fastpipe.store.urls import redact
from fastpipe.util import FolderLock, atomic_write_bytes, usable_cores, write_json_atomic, write_jsonl_atomic


class PhotoChanged(DataError):
    """With --on-change stop: a photo's bytes changed between planning and converting."""


# -- main side ---------------------------------------------------------------------------------------
def _sample_parts(enc: images.Encoded, sample: plan.Sample, classes) -> dict[str, bytes]:
    """The sample's members. Its `.json` has the same fields and types in every sample (readers that infer a
    schema from the first few, as Hugging Face datasets does, would type an empty label list as a list of nulls and
    then fail on the first real one): for multi-label data the multi-hot `labels` in class order and the names
    joined by ';' ("" for none)."""
    if isinstance(sample.label, tuple):
        hot = [int(k in sample.label) for k in range(len(classes))]
        named = {"classes": ";".join(classes[k] for k in sample.label), "labels": hot}
    else:
        named = {"class": classes[sample.label], "label": sample.label}
    meta = {"path": redact(sample.path), **named, "orig_size": list(enc.orig_size), "size": list(enc.size)}
    return {"jpg": enc.jpeg, **encode_label(sample.label, len(classes)),
            "json": json.dumps(meta, sort_keys=True).encode()}


class _SplitRun:
    """Writes one split's samples, journaling each shard with the samples, stats and rejections it closes."""

    def __init__(self, split, samples, cfg, journal, progress: SplitProgress, num_classes, total: int):
        self.split, self.samples, self.journal = split, samples, journal
        # --min-shards: a sample's group is its share of the whole split (every part of a cluster job agrees), so
        # the shards of a split hold equal sample counts, and a resumed run cuts them where the first run did
        self.groups, self.total = cfg.shard_count, max(total, 1)
        self.progress = progress
        if not progress.counts:
            progress.counts = [0] * num_classes
        self._reset_pending(num_classes)
        prefix = cfg.prefixes[SPLITS.index(split)]
        self.writer = ShardWriter(cfg.out, prefix, cfg.shard_bytes, len(progress.shards), self._closed)
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
            self.rejected.append(Rejection(sample.path, result.reason, result.detail).to_dict())  # redacted
        else:
            summary.written_now += 1
            if result.mode != "RGB":
                summary.modes[result.mode] += 1
            self.writer.write(f"{sample.pos:08d}", _sample_parts(result, sample, classes),
                              group=sample.pos * self.groups // self.total)
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

        settings, limit, files, near, _ = initargs  # each node reads the store with credentials of its own
        return RayWorkers(cfg.ray_address, cfg.workers, photos.init_worker,
                          (settings, limit, files.without_credentials(), near), cfg.ray_timeout)
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
            what = previous if not _is_hex(previous) else \
                _other_conversion(cfg, manifest.settings if manifest else journal.read_settings())
            raise ConvertError(f"{cfg.out} holds {what}. Use --overwrite to replace it (only files fastpipe "
                               f"wrote are removed), or choose another OUT folder.")
        outputs.remove(owned | outputs.temporary_files(cfg.out, cfg.prefixes) | {journal.path,
                       cfg.out / f"dataset{cfg.suffix}.json"})
        owned = set()
    ours = readers.names(SPLITS) if cfg.parts == 1 else []  # a cluster job's are written by its merge
    outputs.refuse_conflicts(cfg.out, outputs.foreign_conflicts(cfg.out, cfg.prefixes, owned, ours))
    return previous in fingerprints and manifest is not None


def _other_conversion(cfg: ShardConfig, saved: dict | None) -> str:
    """What OUT holds instead of this conversion: the settings that differ, each with both values, or else other
    input files (the same settings: files added, removed, changed or relabelled)."""
    if saved is None:
        return "a conversion made with other settings or input files"
    changes = cfg.changes_from(saved)
    if changes:
        return f"a conversion made with other settings: {', '.join(changes)}"
    source = cfg.settings()["source"]
    read = f" (it read {saved['source']}, this run {source})" if saved.get("source", source) != source else ""
    other = f", or fastpipe {saved['fastpipe']} planned it" if saved.get("fastpipe", __version__) != __version__ else ""
    return (f"a conversion of other input files{read}, with the same settings: files were added, removed, "
            f"changed or relabelled since{other}")


def _is_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _convert(runs: list[_SplitRun], source, hashed: tuple[dict, dict], pool, summary: Summary,
             on_change: str) -> None:
    """Every split still to do, under one progress bar (with a Ray pool: its nodes busy and tasks retried).
    `hashed`: each photo's sha256 and pixels, as the plan read them."""
    with tqdm(total=sum(len(r.samples) - r.pos for r in runs), desc="converting", unit="img",
              mininterval=0.5) as bar:
        for run in runs:
            summary.converted_now += _convert_split(run, source, hashed, pool, bar, summary, on_change)


def _convert_split(run: _SplitRun, source, hashed: tuple[dict, dict], pool, bar, summary: Summary,
                   on_change: str) -> int:
    todo, (hashes, pixels) = run.samples[run.pos:], hashed
    # each photo with the hash the plan has for it: the worker converts those bytes or none (photos.convert_one)
    where = [photos.Planned(source.files.join(s.path), hashes[s.path]) for s in todo]
    # 4 a task: fewer messages per image; more would leave one worker idle longer at the end
    results = pool.imap(photos.convert_one, where, chunksize=4, pixels=[pixels.get(s.path, 0) for s in todo]) \
        if pool else map(photos.convert_one, where)
    try:
        for result in results:
            if on_change == "stop" and isinstance(result, images.Rejected) and result.reason == "changed":
                raise PhotoChanged(f"{run.samples[run.pos].path}: {result.detail} (--on-change stop: the shards "
                                   f"finished before are kept)")
            run.add(result, source.classes, summary)
            bar.update()
            if pool is not None:
                bar.set_postfix_str(pool.status(), refresh=False)
    except BaseException:
        run.writer.abort()  # no half shard under a final name; the journal keeps the finished ones
        raise
    run.finish()
    return len(todo)


def _finalize(cfg, source, progress, early: list[Rejection], ids: dict, pool, found: tuple) -> Manifest:
    """rejected.jsonl, near-duplicates.jsonl, previews, then dataset.json last: a conversion is complete only when
    every output is, so a run stopped in between (a full disk while drawing previews) is finished by the rerun, not
    declared done."""
    rejected = sorted([r.to_dict() for r in early] + [r for p in progress.values() for r in p.rejected],
                      key=lambda r: (r["path"], r["reason"]))
    write_jsonl_atomic(cfg.out / f"rejected{cfg.suffix}.jsonl", rejected)
    near, plain, table = found
    write_jsonl_atomic(cfg.out / f"near-duplicates{cfg.suffix}.jsonl", near)
    if table is not None:
        atomic_write_bytes(cfg.out / f"fingerprints{cfg.suffix}.npz", table)
    manifest = Manifest(
        classes=tuple(source.classes),
        splits={n: SplitInfo(tuple(p.shards), tuple(p.counts)) for n, p in progress.items()},
        stats=progress["train"].stats,
        settings={**cfg.settings(), **ids, "fastpipe": __version__},  # ids: plan.fingerprints
        components=Components(label="labels") if source.multilabel else Components(),
        root=cfg.out,
        outputs={"rejected": f"rejected{cfg.suffix}.jsonl", "near_duplicates": {
            "file": f"near-duplicates{cfg.suffix}.jsonl", "mode": cfg.near_duplicates,
            "threshold": cfg.near_threshold, "groups": len(near),
            "photos": sum(len(g["photos"]) for g in near), "straddling": sum(g["straddles"] for g in near),
            "label_conflicts": sum(g["label_conflict"] for g in near), "plain": plain,
            **({"fingerprints": f"fingerprints{cfg.suffix}.npz"} if table is not None else {})}},
        task="multilabel" if source.multilabel else "single",
    )
    if cfg.parts == 1:
        names = previews.contact_sheets(manifest, cfg.out / "previews", seed=cfg.seed, pool=pool)
        manifest.outputs["previews"] = {c: f"previews/{f}" for c, f in names.items()}
        sheet = previews.near_copies_sheet(near, lambda rel: _source_bytes(cfg, source, rel), cfg.max_pixels)
        if sheet is not None:  # beside the classes' sheets, under a name no class's can take
            name = "near-duplicates.jpg" if "near-duplicates.jpg" not in names.values() else "_near-duplicates.jpg"
            atomic_write_bytes(cfg.out / "previews" / name, sheet)
            manifest.outputs["near_duplicates"]["preview"] = f"previews/{name}"
        manifest.outputs["readers"] = readers.write(manifest, cfg.out)
    else:  # a cluster job's previews are drawn at merge time, from every part's uniform sample of each class
        manifest.outputs["preview_candidates"] = previews.candidates(manifest, cfg.seed, cfg.part)
    write_json_atomic(cfg.out / f"dataset{cfg.suffix}.json", manifest.to_dict())
    return manifest


def _source_bytes(cfg, source, rel: str) -> bytes | None:
    data = photos.read(source.files.join(rel), cfg.max_file_size, source.files)
    return None if isinstance(data, images.Rejected) else data


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
    source = discover(cfg.src, exclude=cfg.out, limit=cfg.max_file_size, max_rows=cfg.max_rows)
    if open_location(cfg.out, what="OUT").folder is None:  # a store: converted in a staging folder, uploaded
        return publish.shard_to_url(cfg, lambda staged: _shard_into(staged, source, start))
    return _shard_into(cfg, source, start)


def _shard_into(cfg: ShardConfig, source, start: float) -> Summary:
    cfg.out.mkdir(parents=True, exist_ok=True)
    summary = Summary(cfg.out, discovered=len(source.items) + len(source.rejections), ignored=source.ignored,
                      notes=list(source.notes))
    with FolderLock(cfg.out, f"fastpipe shard {cfg.src} {cfg.out}"):
        _run(cfg, source, summary, start)
    summary.seconds = time.perf_counter() - start
    return summarise(summary, cfg)


def _plan(cfg: ShardConfig, source, workers: int, pool):
    """(this part's samples per split, each whole split's size, the plan's fingerprints, early rejections, each
    photo's (sha256, pixels))."""
    # With fingerprints, hashing converts each photo (spool.py): the worker processes do it where the photos are on
    # this machine (threads of this process hold the GIL for Pillow's Python: fastpipe converted at 0.66 of
    # litdata's rate so, docs/benchmarks.md); a store's photos are read by threads, whose reads in flight hide its
    # latency.
    local_work = cfg.near_duplicates != "off" and source.files.folder is not None
    hashes, early, pixels, fps = plan.hash_files(source, workers, pool if cfg.uses_ray or local_work else None)
    items, duplicates = plan.deduplicate(list(source.items), hashes)
    groups = nearplan.find(items, fps, cfg.near_threshold) if cfg.near_duplicates != "off" else []
    items, groups, near = nearplan.resolve(items, groups, cfg.near_duplicates)
    duplicates += near
    by_split = plan.split_items(items, cfg.val_fraction, cfg.seed, source.multilabel, groups)
    ordered = {n: plan.order_split(by_split[n], source.classes, cfg.seed, salt, source.multilabel)
               for salt, n in enumerate(SPLITS)}
    mine = {n: [s[i] for i in plan.part_range(len(s), cfg.part, cfg.parts)] for n, s in ordered.items()}
    # Refusals found before any decoding are recorded once, by part 0, for a cluster job.
    early_all = list(source.rejections) + early + duplicates if cfg.part == 0 else []
    totals = {n: len(s) for n, s in ordered.items()}  # the whole split's size: --min-shards cuts by its share
    split_of = {s.path: n for n, samples in ordered.items() for s in samples}
    near_groups = [g.record(split_of) for g in groups]
    plain = sum(bool(nearcopy.plain(f[None])[0]) for f in fps.values())
    kept = [(n, s.path) for n, samples in ordered.items() for s in samples if s.path in fps]
    return (mine, totals, plan.fingerprints(cfg.settings(), ordered, mine, hashes), early_all, (hashes, pixels),
            (near_groups, plain, nearcopy.table(kept, fps) if cfg.near_duplicates != "off" else None))


def _run(cfg: ShardConfig, source, summary: Summary, start: float) -> None:
    workers = usable_cores() if cfg.workers is None else cfg.workers
    near = cfg.near_duplicates != "off"
    kept = spool.folder(cfg.out, cfg.image_settings(), cfg.suffix) if near and not cfg.uses_ray else None
    initargs = (cfg.image_settings(), cfg.max_file_size, source.files,
                near, str(kept) if kept else None)
    pool = _make_pool(cfg, source, workers, initargs)
    photos.init_worker(*initargs)  # this process converts too (no pool), and hashes
    clock = _Clock(summary.phases, start)
    try:
        clock.lap("start")
        mine, totals, fingerprints, early, hashed, near = _plan(cfg, source, workers, pool)
        if source.multilabel:
            summary.unlabelled = [s.path for n in SPLITS for s in mine[n] if not s.label]
        clock.lap("hash")
        journal = Journal(cfg.out / journal_name(cfg.suffix), fingerprints[0], cfg.settings())
        if _guard(cfg, fingerprints[:2], journal):
            summary.up_to_date = True
            return
        progress = journal.load(cfg.out)
        summary.resumed = sum(p.end for p in progress.values())
        runs = [_SplitRun(n, mine[n], cfg, journal, p, len(source.classes), totals[n]) for n in SPLITS
                if not (p := progress.setdefault(n, SplitProgress())).done]
        _convert(runs, source, hashed, pool, summary, cfg.on_change)
        clock.lap("convert")
        _finalize(cfg, source, progress, early, {"fingerprint": fingerprints[0], "plan": fingerprints[2]}, pool, near)
        journal.remove()
        if kept is not None:
            spool.remove(kept)
        clock.lap("finish")
        summary.notes += pool.notes() if pool is not None else []
    finally:
        if pool is not None:
            pool.terminate()


__all__ = ["ConvertError", "ShardConfig", "Summary", "shard"]  # the settings are config.py's, used from here too

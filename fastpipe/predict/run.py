"""`fastpipe predict`: a trained model's classes for new photos, prepared exactly as its training photos were.

Each photo goes through the converter's image step with the data set's settings (photos.py) in worker processes,
and the results are written, a chunk at a time, as a shard of a temporary data set: the bytes a shard of the
training data would hold. The run's validation loader (any backend: torch, dali, nvjpeg) reads it with the
validation transform recorded in the model card, so the model sees what validation showed it, photo for photo. The
workers convert the next chunk while the model scores this one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from fastpipe.convert import images
from fastpipe.convert.workers import Workers
from fastpipe.convert.writer import ShardWriter
from fastpipe.dataset.manifest import Components, Manifest, SplitInfo, Stats
from fastpipe.dataset.shardformat import encode_label
from fastpipe.loaders import cpu_ops, make_loader_from
from fastpipe.predict import photos
from fastpipe.predict.config import PredictConfig
from fastpipe.predict.leak import TrainingPhotos
from fastpipe.predict.model import NON_FINITE, Model, load_model
from fastpipe.predict.output import NEAR_TRAINING, Output, Row
from fastpipe.util import usable_cores


@dataclass
class Result:
    rows: int
    rejected: int
    out: Path
    lines: list[str]


def predict(cfg: PredictConfig, log=print) -> Result:
    model = load_model(cfg.model, cfg.weights, cfg.device, cfg.trust_pt2)
    for note in model.notes:
        log(f"note: {note}")
    found = photos.find(cfg.src, model.classes, model.multilabel, cfg.max_file_size)
    for note in found.notes:
        log(f"note: {note}")
    cfg = replace(cfg, backend=_backend(cfg, model, log))
    log(f"model: {model.source} ({model.card['model']}, {len(model.classes)} classes, {model.card['image_size']} px)"
        f"; {len(found.items)} photos")
    output = Output(Path(cfg.out), cfg.out_format, model, cfg.top_k)
    training = TrainingPhotos.of_run(cfg.model)
    with output, _cores_left(model, cfg), tqdm(total=len(found.items), unit="photo", desc="predict") as bar:
        for rows in _chunks(found, model, cfg, training):
            output.write(rows)
            bar.update(len(rows))
        output.write([Row(r.path, None, None, r.reason, r.detail) for r in found.rejections])
    lines = output.finish()
    return Result(output.count, output.rejected, Path(cfg.out), lines)


def _backend(cfg: PredictConfig, model: Model, log) -> str:
    """The backend asked, or the one the run validated with, whose pixels are validation's; one not installed here
    gives way to torch, and a CPU decoder other than validation's is said."""
    backend = cfg.backend or model.card.get("backend", "torch")
    if backend == "dali" and importlib.util.find_spec("nvidia.dali") is None and not cfg.backend:
        from fastpipe.loaders.dali import install_command

        log("note: the run validated with the dali backend, not installed here: predicting with torch, whose pixels "
            f"differ slightly from validation's ({install_command()} for the same)")
        backend = "torch"
    ran, here = model.card.get("decoder", ""), cpu_ops.active(model.card["cpu_decoder"])
    if backend == "torch" and ran and ran != here:
        log(f"note: validation decoded with {ran}; here it is {here}: pixels may differ slightly")
    return backend


@contextlib.contextmanager
def _cores_left(model: Model, cfg: PredictConfig):
    """On a CPU the conversion workers take the cores: the model gets those left, at least one thread. torch's
    threads beside busy workers wait on each other (2 workers on 2 cores: 51 photos/s with one model thread, 36 to 44
    with two; benchmarks/bench_predict.py)."""
    workers, before = photos.workers_for(cfg.workers), torch.get_num_threads()
    if model.device.type == "cpu" and workers > 1:
        torch.set_num_threads(max(1, usable_cores() - workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def chunk_size(batch_size: int) -> int:
    """Photos per temporary shard: enough batches that making a loader is a small share of the work."""
    return min(max(128, 4 * batch_size), 8192)  # prepared photos held in memory at once: bounded


def _chunks(found: photos.Photos, model: Model, cfg: PredictConfig, training: TrainingPhotos | None = None):
    """The rows of every photo, a chunk at a time, in SRC's order; a photo that is a near-copy of one the run
    trained on says so in its detail."""
    size, items = chunk_size(cfg.batch_size), found.items
    prepared = _prepared(found, model, cfg, size)
    try:
        for start in range(0, len(items), size):
            part = items[start : start + size]
            ready = [next(prepared) for _ in part]
            rows = _predict_chunk(part, ready, model, cfg)
            if training is not None:
                for row, copy in zip(rows, training.copies([r if isinstance(r, bytes) else None for r in ready])):
                    if copy is not None and row.status == "ok":
                        row.detail = f"{NEAR_TRAINING} {copy[0]} ({copy[1]} bits)"
            yield rows
    finally:
        prepared.close()


def _prepared(found: photos.Photos, model: Model, cfg: PredictConfig, ahead: int):
    """Each photo as a shard would hold it (bytes), or its rejection; in order, from worker processes."""
    initargs = (photos.settings_of(model.card), cfg.max_file_size, found.files)
    photos.init_worker(*initargs)
    workers = photos.workers_for(cfg.workers)
    where = [p.where for p in found.items]
    if workers <= 1:
        yield from map(photos.prepare_one, where)
        return
    pool = Workers(workers, photos.init_worker, initargs)
    try:
        yield from pool.imap(photos.prepare_one, where, ahead=max(2, ahead // workers))
    finally:
        pool.terminate()


def _predict_chunk(part, prepared: list, model: Model, cfg: PredictConfig) -> list[Row]:
    rows: list[Row | None] = [None] * len(part)
    for i, (p, r) in enumerate(zip(part, prepared)):
        if isinstance(r, images.Rejected):
            rows[i] = Row(p.name, p.label, None, r.reason, r.detail)
    good = [i for i, r in enumerate(prepared) if isinstance(r, bytes)]
    if good:
        with tempfile.TemporaryDirectory(prefix="fastpipe-predict-") as tmp:
            manifest = _chunk_data_set(Path(tmp), [(i, prepared[i]) for i in good], model)
            skipped = _score(manifest, model, cfg, part, prepared, rows)
    for i in good:
        if rows[i] is None:  # the loader could not decode the prepared photo
            why = next((s for s in skipped if f"{i:08d}" in s), "the validation transform could not decode it")
            rows[i] = Row(part[i].name, part[i].label, None, "corrupt", why)
    return rows


def _score(manifest: Manifest, model: Model, cfg: PredictConfig, part, prepared, rows) -> list[str]:
    loader = make_loader_from(manifest, cfg.loader(model.card, cfg.backend, model.takes_float))
    try:
        for x, _, keys in loader:
            scores = model.scores(x)
            finite = torch.isfinite(scores).all(1).tolist()
            for key, p, ok in zip(keys, scores.tolist(), finite):
                i = int(key.key)
                rows[i] = Row(part[i].name, part[i].label, p, image=prepared[i]) if ok else \
                    Row(part[i].name, part[i].label, None, "non-finite", NON_FINITE)
        return list(loader.stats.skipped_keys)
    finally:
        loader.close()


def _chunk_data_set(folder: Path, samples: list[tuple[int, bytes]], model: Model) -> Manifest:
    """One val shard of the prepared photos (keys: their place in the chunk), and its manifest."""
    k = len(model.classes)
    label = () if model.multilabel else 0  # the loader's labels are not used: SRC's are kept with the rows
    writer = ShardWriter(folder, "val", 1 << 62)
    for i, jpeg in samples:
        writer.write(f"{i:08d}", {"jpg": jpeg, **encode_label(label, k)})
    shard = writer.finish()
    counts = (0,) * k if model.multilabel else (len(samples),) + (0,) * (k - 1)
    convert = model.card.get("convert") or {}
    return Manifest(tuple(model.classes), {"val": SplitInfo((shard,), counts)}, Stats.zero(),
                    {"short_side": convert.get("short_side")} if convert else {},
                    Components(label="labels", meta=None) if model.multilabel else Components(meta=None),
                    folder, task=model.card["task"])

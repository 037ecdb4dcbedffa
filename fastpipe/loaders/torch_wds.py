"""torch backend: WebDataset shards → DataLoader workers (decode + augment on uint8, batched in the workers).

Also the host side of the nvjpeg backend, whose workers only read bytes and draw the crop boxes (mode="bytes").
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fastpipe.loaders import cpu_ops
from fastpipe.loaders.base import Loader
from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.epoch import batches_per_epoch, train_segment, val_batches, worker_batches
from fastpipe.loaders.shards import RawSample, ShardSet
from fastpipe.manifest import Manifest

log = logging.getLogger("fastpipe")


class SampleError(RuntimeError):
    """A sample that can't be decoded, with on_error="raise"."""


def _repeats(weights, rng: np.random.Generator, label: int) -> int:
    """Repeat-factor sampling: a sample of class c is emitted floor(w_c) + Bernoulli(frac(w_c)) times, so every
    class contributes about N/k samples per epoch (oversampling rare classes, subsampling common ones)."""
    w = weights[label]
    return int(w) + int(rng.random() < w - int(w))


def _shuffled(samples: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    """webdataset's shuffle buffer: emit a random element of a buffer kept `size` full."""
    buf: list = []
    for s in samples:
        if len(buf) < size:
            buf.append(s)
            continue
        j = int(rng.integers(len(buf)))
        buf[j], s = s, buf[j]
        yield s
    rng.shuffle(buf)
    yield from buf


def _batch_buffer(n: int, size: int) -> torch.Tensor:
    """uint8 NHWC batch, in shared memory inside a DataLoader worker: sending it to the main process then
    costs no copy (what default_collate does for its batches)."""
    shape = (n, size, size, 3)
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(n * size * size * 3)
    return torch.tensor([], dtype=torch.uint8).set_(storage).view(shape)


class SampleStream(IterableDataset):
    """One DataLoader worker's share of the epoch (see epoch.py), as ready batches."""

    def __init__(self, shards: ShardSet, cfg: LoaderConfig, weights, mode: str = "decode"):
        self.shards, self.cfg, self.weights, self.mode = shards, cfg, list(weights), mode
        # Shared memory, so that set_epoch reaches persistent workers.
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.batches = batches_per_epoch(cfg.split, shards.total, cfg.batch_size, cfg.world_size)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, cfg = int(self.epoch[0]), self.cfg
        rng = np.random.default_rng([cfg.seed, epoch, cfg.rank, worker])
        if cfg.split == "val":
            batches = val_batches(self.shards.counts, cfg.rank, cfg.world_size, cfg.batch_size)
            for b in range(worker, len(batches), workers):
                raw = [s for p in batches[b] for s in self.shards.read(p)]
                yield self._assemble(iter(raw), len(raw), rng, limit=len(raw))
            return
        pieces = train_segment(self.shards.counts, cfg.seed, epoch, cfg.rank, cfg.world_size, worker, workers,
                               cfg.batch_size)
        stream = self._stream(pieces, rng)
        for _ in range(worker_batches(self.batches, worker, workers)):
            yield self._assemble(stream, cfg.batch_size, rng, limit=100 * cfg.batch_size)

    def _lap(self, pieces, rng) -> Iterator[RawSample]:
        """One pass over the segment (balanced: each sample repeated by its class's repeat factor)."""
        for piece in pieces:
            for s in self.shards.read(piece):
                yield from itertools.repeat(s, _repeats(self.weights, rng, s.label) if self.cfg.balance else 1)

    def _stream(self, pieces, rng) -> Iterator[RawSample]:
        """The segment shuffled through the buffer lap by lap: each lap is emitted whole before the next one
        starts, so an epoch never repeats a sample while another is still waiting in the buffer. A second lap
        is read only when skipped samples (or balancing) leave the first one short."""
        for _ in itertools.count():
            yield from _shuffled(self._lap(pieces, rng), self.cfg.shuffle_buffer, rng)

    def _assemble(self, samples, size: int, rng, limit: int) -> tuple:
        """Up to `size` good samples from `samples`, trying at most `limit`; decoded into one batch buffer."""
        buffer = _batch_buffer(size, self.cfg.image_size) if self.mode == "decode" else None
        items, tried = [], 0
        while len(items) < size:
            sample = next(samples, None)
            if sample is None:
                break
            tried += 1
            if tried > limit and self.cfg.split == "train":
                raise SampleError(f"{tried} samples tried for one batch of {size}: the shards are mostly "
                                  f"undecodable; run `fastpipe inspect --verify`")
            out = buffer[len(items)].numpy() if buffer is not None else None
            x = self._prepare(sample, rng, out)
            if x is not None:
                items.append(x)
        return self._collate(items, tried, buffer)

    def _prepare(self, s: RawSample, rng, out=None):
        """Decode + augment (mode decode), read the header and draw the crop (bytes), or pass the bytes (raw)."""
        cfg = self.cfg
        try:
            if self.mode == "raw":  # for DALI's external source: DALI decodes
                return np.frombuffer(s.image, dtype=np.uint8), s.label
            if self.mode == "bytes":
                w, h = cpu_ops.jpeg_size(s.image)
                if cfg.split == "train":
                    box, flip = cpu_ops.draw_train_params(w, h, rng, cfg.min_scale)
                else:
                    box, flip = cpu_ops.center_crop_box(w, h, cfg.image_size, cfg.val_crop), False
                return torch.frombuffer(bytearray(s.image), dtype=torch.uint8), box, flip, s.label
            if cfg.split == "train":
                cpu_ops.decode_train(s.image, cfg.image_size, rng, cfg.min_scale, cfg.cpu_decoder, out)
            else:
                cpu_ops.decode_val(s.image, cfg.image_size, cfg.val_crop, cfg.cpu_decoder, out)
            return None, s.label  # the pixels are in the batch buffer already
        except Exception as e:  # any decoder failure is this sample's problem, reported with its key
            msg = f"sample {s.key} in shard {s.shard}: {type(e).__name__}: {e}"
            if cfg.on_error == "raise":
                raise SampleError(msg) from e
            warnings.warn(f"skipping {msg}", stacklevel=2)
            return None

    def _collate(self, items: list, tried: int, buffer: torch.Tensor | None) -> tuple:
        skipped = tried - len(items)
        if self.mode == "raw":
            return [it[0] for it in items], [np.array([it[1]], dtype=np.int32) for it in items], skipped
        labels = torch.tensor([it[-1] for it in items], dtype=torch.int64)
        if self.mode == "bytes":
            boxes = torch.tensor([it[1] for it in items], dtype=torch.int64).reshape(-1, 4)
            flips = torch.tensor([it[2] for it in items], dtype=torch.bool)
            return [it[0] for it in items], boxes, flips, labels, skipped
        return buffer[: len(items)], labels, skipped


class TorchLoader(Loader):
    name = "torch"
    mode = "decode"

    def __init__(self, manifest: Manifest, cfg: LoaderConfig):
        super().__init__(manifest, cfg)
        self.shards = ShardSet(manifest, self.cfg.split)
        self.num_workers = self._pick_workers()
        self.dataset = SampleStream(self.shards, self.cfg, manifest.class_weights(), self.mode)
        w = self.num_workers
        self.dataloader = DataLoader(
            self.dataset, batch_size=None, num_workers=w, pin_memory=self.cfg.pin_memory,
            persistent_workers=w > 0, prefetch_factor=self.cfg.prefetch_factor if w > 0 else None)

    def _pick_workers(self) -> int:
        if self.cfg.num_workers is not None:
            return self.cfg.num_workers
        from fastpipe.loaders.workers import tuned_workers

        return tuned_workers(self.manifest, self.cfg, self.name)

    def describe(self) -> dict:
        return {**super().describe(), "num_workers": self.num_workers}

    def _host_batches(self):
        self.dataset.epoch[0] = self.epoch
        return iter(self.dataloader)

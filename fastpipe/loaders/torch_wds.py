"""torch backend: WebDataset shards → DataLoader workers (decode + augment on uint8, batched in the workers).

Also the host side of the nvjpeg backend, whose workers only read bytes and draw the crop boxes (mode="bytes").
"""

from __future__ import annotations

import itertools
import logging
import sys
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


class BufferPool:
    """uint8 NHWC batch buffers, in shared memory inside DataLoader workers, reused once released.

    A batch in shared memory crosses to the main process without a copy (what default_collate does), but a
    fresh 10 MB buffer per batch costs its first-touch page faults (about a fifth of the decode time here:
    benchmarks/bench_loaders.py). So each worker keeps up to `ring` buffers and reuses one only after the main
    process has released it explicitly, through a shared flag, once it has copied the batch out (into a float
    tensor, or a pinned and device copy). Nothing depends on DataLoader's scheduling; when no buffer is free
    (or the caller keeps the buffer itself: uint8 output on the CPU) a fresh one is allocated, as before.
    """

    def __init__(self, workers: int, ring: int, batch: int, size: int):
        self.shape, self.ring = (batch, size, size, 3), ring
        self.free = torch.zeros((max(workers, 1), max(ring, 1)), dtype=torch.int8).share_memory_()
        self.pool: list[torch.Tensor] = []  # this worker's buffers (filled inside the worker process)

    def _new(self) -> torch.Tensor:
        if get_worker_info() is None:
            return torch.empty(self.shape, dtype=torch.uint8)
        storage = torch.UntypedStorage._new_shared(int(np.prod(self.shape)))
        return torch.tensor([], dtype=torch.uint8).set_(storage).view(self.shape)

    def take(self) -> tuple[torch.Tensor, int]:
        """A buffer and its slot id (-1: not pooled, never released)."""
        info = get_worker_info()
        if info is None or not self.ring:
            return self._new(), -1
        flags = self.free[info.id]
        for slot, buffer in enumerate(self.pool):
            if flags[slot] == 1:
                flags[slot] = 0
                return buffer, info.id * self.ring + slot
        if len(self.pool) < self.ring:
            self.pool.append(self._new())
            flags[len(self.pool) - 1] = 0
            return self.pool[-1], info.id * self.ring + len(self.pool) - 1
        return self._new(), -1

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.free.view(-1)[slot] = 1


class SampleStream(IterableDataset):
    """One DataLoader worker's share of the epoch (see epoch.py), as ready batches."""

    def __init__(self, shards: ShardSet, cfg: LoaderConfig, weights, mode: str = "decode",
                 buffers: BufferPool | None = None):
        self.shards, self.cfg, self.weights, self.mode = shards, cfg, list(weights), mode
        self.buffers = buffers or BufferPool(1, 0, cfg.batch_size, cfg.image_size)
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
        buffer, slot = self.buffers.take() if self.mode == "decode" else (None, -1)
        items, tried = [], 0
        while len(items) < size:
            sample = next(samples, None)
            if sample is None:
                break
            tried += 1
            if tried > limit and self.cfg.split == "train":
                raise SampleError(f"{tried} samples tried for one batch of {size}: the shards are mostly "
                                  f"undecodable; run `fastpipe inspect --verify`")
            out = buffer[len(items)].numpy() if buffer is not None else None  # decode straight into the batch
            x = self._prepare(sample, rng, out)
            if x is not None:
                items.append(x)
        return self._collate(items, tried, buffer, slot)

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

    def _collate(self, items: list, tried: int, buffer: torch.Tensor | None, slot: int) -> tuple:
        skipped = tried - len(items)
        if self.mode == "raw":
            return [it[0] for it in items], [np.array([it[1]], dtype=np.int32) for it in items], skipped
        labels = torch.tensor([it[-1] for it in items], dtype=torch.int64)
        if self.mode == "bytes":
            boxes = torch.tensor([it[1] for it in items], dtype=torch.int64).reshape(-1, 4)
            flips = torch.tensor([it[2] for it in items], dtype=torch.bool)
            return [it[0] for it in items], boxes, flips, labels, skipped
        return buffer[: len(items)], labels, skipped, slot


def _worker_context():
    """fork (fast, the default) unless this process holds DALI: a forked copy of a DALI pipeline hangs in its
    destructor when the child's garbage collector meets it (seen here). Then forkserver: workers fork from a
    clean server process that has imported this module once."""
    if "nvidia.dali" not in sys.modules:
        return None
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class TorchLoader(Loader):
    name = "torch"
    mode = "decode"

    def __init__(self, manifest: Manifest, cfg: LoaderConfig):
        super().__init__(manifest, cfg)
        self.shards = ShardSet(manifest, self.cfg.split)
        self.num_workers, self.prefetch = self._fit_shared_memory(self._pick_workers())
        w = self.num_workers
        # Buffers are recycled when every batch is copied out before the caller sees it (see BufferPool), or when
        # the caller promises to be done with a batch when it asks for the next (reuse_output).
        self.hands_out_buffer = self.device.type == "cpu" and not self.cfg.normalize
        self.recycle = self.mode == "decode" and (not self.hands_out_buffer or self.cfg.reuse_output)
        self._held = -1  # the slot of the buffer the caller holds (reuse_output)
        self.buffers = BufferPool(w, self.prefetch + 2 if self.recycle else 0, self.cfg.batch_size,
                                  self.cfg.image_size)
        self.dataset = SampleStream(self.shards, self.cfg, manifest.class_weights(), self.mode, self.buffers)
        self.dataloader = DataLoader(
            self.dataset, batch_size=None, num_workers=w, pin_memory=self.cfg.pin_memory,
            persistent_workers=w > 0, prefetch_factor=self.prefetch if w > 0 else None,
            multiprocessing_context=_worker_context() if w > 0 else None, worker_init_fn=cpu_ops.one_thread)

    def _pick_workers(self) -> int:
        from fastpipe.loaders.workers import heuristic_workers, tuned_workers

        if self.cfg.num_workers == "probe":
            return tuned_workers(self.manifest, self.cfg, self.name)
        if self.cfg.num_workers is None:
            return heuristic_workers(self.cfg.world_size if self.device.type == "cuda" else 1)
        return self.cfg.num_workers

    def _fit_shared_memory(self, workers: int) -> tuple[int, int]:
        from fastpipe.loaders.workers import fit_shared_memory, shm_free

        if self.mode == "decode":
            batch_bytes = self.cfg.batch_size * self.cfg.image_size**2 * 3
        else:  # encoded bytes: the data set's mean stored sample
            split = self.manifest.split(self.cfg.split)
            batch_bytes = self.cfg.batch_size * sum(s.bytes for s in split.shards) // max(split.samples, 1)
        workers, prefetch, note = fit_shared_memory(workers, batch_bytes, self.cfg.prefetch_factor, shm_free())
        if note:
            warnings.warn(note, stacklevel=3)
        return workers, prefetch

    def describe(self) -> dict:
        return {**super().describe(), "num_workers": self.num_workers, "prefetch_factor": self.prefetch}

    def _host_batches(self):
        self.dataset.epoch[0] = self.epoch
        if self.recycle:
            # Idle workers between epochs: nothing is being written, and iter() drops the batches an epoch
            # abandoned half-way left in flight, so every pooled buffer is free again.
            self.buffers.free.fill_(1)
            self._held = -1
        return iter(self.dataloader)

    def _to_device(self, batch):
        images, labels, skipped, slot = batch
        x, y = self.step.images(images), self.step.labels(labels)
        if not self.recycle:
            return x, y, skipped
        if self.hands_out_buffer:  # reuse_output: the previous batch is done now that the next is asked for
            self.buffers.release(self._held)
            self._held = slot
        else:
            self.buffers.release(slot)  # x is new memory now (float, or a device copy): the worker may reuse it
        return x, y, skipped

"""What each backend does on the host with a batch of raw samples, in the loader workers.

- CpuDecode (torch backend): decode + random-resized-crop + flip (train) or resize + centre crop (val) into a
  pooled uint8 batch buffer.
- EncodedBytes (nvjpeg): the JPEG bytes, and each sample's crop box and flip drawn from its header (the same draws
  as CpuDecode), for decoding on the device.
- Raw (DALI): the JPEG bytes as numpy arrays, for DALI's external source.

A sample that fails to decode, or that no decoder may be given (more pixels than the data set's max_pixels, a JPEG
of more scans than libjpeg-turbo's limit: imageguard.py, from its header), is named with its shard and key. In train
batches it is replaced by a copy of a good sample of the same batch, so every batch keeps its shape (static shapes
for torch.compile, no tiny batch for BatchNorm); in val batches it is left out, so accuracy never counts an image
twice. With on_error="raise" the batch stops with the sample's name instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from fastpipe.dataset.imageguard import DEFAULT_MAX_PIXELS
from fastpipe.errors import DataError
from fastpipe.loaders import cpu_ops, jpegcrop
from fastpipe.loaders.batch import BufferPool, HostBatch, RawBatch
from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.rng import SampleRng


class SampleError(DataError):
    """A sample that can't be decoded (with on_error="raise"), or a batch none of whose samples decode."""


def _failure(raw: RawBatch, i: int, e: Exception) -> str:
    return f"{raw.name(i)}: {type(e).__name__}: {str(e)[:200]}"


class _Prepare:
    def __init__(self, cfg: LoaderConfig, num_classes: int, multilabel: bool = False,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        self.cfg, self.train = cfg, cfg.split == "train"
        self.num_classes, self.multilabel = num_classes, multilabel
        self.max_pixels = max_pixels  # the data set's (Manifest.max_pixels)

    def rngs(self, epoch: int, positions) -> list[SampleRng | None]:
        """Each train sample's crop and flip generator, keyed by (seed, epoch, position in the epoch)."""
        return SampleRng.batch((self.cfg.seed, epoch), positions) if self.train else [None] * len(positions)

    def _bad(self, raw: RawBatch, i: int, e: Exception, skipped: list[str]) -> None:
        if self.cfg.on_error == "raise":
            raise SampleError(_failure(raw, i, e)) from e
        skipped.append(_failure(raw, i, e))

    @staticmethod
    def _fill(good: list[int], n: int, what: str) -> list[int]:
        """Index of the sample whose copy fills each place of a train batch (itself when it decoded)."""
        if not good:
            raise SampleError(f"none of the {n} samples of a batch decodes ({what}): the shards are damaged; "
                              f"run `fastpipe inspect --verify`")
        ok = set(good)
        return [i if i in ok else good[i % len(good)] for i in range(n)]


@dataclass(slots=True)
class _Job:
    """A batch being decoded: its samples, draws and buffer, and each sample's outcome."""

    raw: RawBatch
    positions: np.ndarray
    epoch: int
    buffer: torch.Tensor | np.ndarray  # what the batch carries (BufferPool.take)
    slot: int
    pixels: np.ndarray
    states: np.ndarray | None  # each train sample's generator state (SampleRng.states); None for val and C
    status: bytearray  # each sample's: 0 decoded, 1 not (yet)
    failures: list[str | None]
    decode_s: list[float]  # each part's time (parts may run in several threads at once)
    key: int = 0  # SampleRng.key_state((seed, epoch)): what the C path mixes each position into


class CpuDecode(_Prepare):
    def __init__(self, cfg: LoaderConfig, num_classes: int, multilabel: bool, buffers: BufferPool,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(cfg, num_classes, multilabel, max_pixels)
        self.buffers = buffers
        # training samples through the crop decoder's C path, a part of a batch a call, without the GIL; it takes the
        # files the Python path would give the crop decoder and hands back the others, so the pixels are the same
        self.chunked = (self.train and cfg.cpu_decoder in ("auto", "crop") and jpegcrop.chunked()
                        and cpu_ops.chunk_matches())
        self._chunk = jpegcrop.chunk_decoder(cfg.image_size, cfg.min_scale, max_pixels) if self.chunked else None

    def __call__(self, raw: RawBatch, positions, epoch: int) -> HostBatch:
        job = self.begin(raw, positions, epoch)
        self.part(job, 0, len(raw))
        return self.end(job)

    # A batch in three steps, so that worker threads can share one batch's samples (threads.py): begin (its buffer
    # and draws), part (samples lo..hi, decoded straight into the buffer's rows; parts may run at once), end.
    def begin(self, raw: RawBatch, positions, epoch: int, worker: int | None = None) -> _Job:
        """`worker`: a worker thread's number, whose buffer pool the batch's buffer comes from."""
        buffer, pixels, slot = self.buffers.take(worker)
        n = len(raw)
        # one view per batch: a tensor index + .numpy() per image showed in the profile. The C path derives each
        # sample's generator state itself; the Python path's are drawn here, or for a sample the C path leaves to it
        states = SampleRng.states((self.cfg.seed, epoch), positions) if self.train and not self.chunked else None
        key = SampleRng.key_state((self.cfg.seed, epoch)) if self.chunked else 0
        positions = np.ascontiguousarray(positions, np.int64)  # once a batch: its chunks index it in C
        pixels = pixels if len(pixels) == n else pixels[:n]
        return _Job(raw, positions, epoch, buffer, slot, pixels, states, bytearray(b"\x01") * n, [None] * n, [], key)

    def part(self, job: _Job, lo: int, hi: int, shards=None) -> None:
        """Samples lo..hi of the batch; `shards`: the ShardSet to fetch a sample again through (its own maps)."""
        start, status = time.perf_counter(), job.status
        todo = range(lo, hi)
        if self._chunk is not None and hi > lo:  # the C path: what it leaves (status 1) goes the Python path
            raw = job.raw
            if not self._chunk(raw.views, raw.spans, job.key, job.positions, job.pixels, status, lo, hi):
                todo = ()
            else:
                todo = [i for i in todo if status[i]]
        for i in todo:
            self._one(job, i, shards)
        job.decode_s.append(time.perf_counter() - start)

    def _one(self, job: _Job, i: int, shards) -> None:
        try:
            self._decode(job.raw.images[i], self._rng(job, i), job.pixels[i])
            job.status[i] = 0
        except Exception as e:  # any decoder failure is this sample's problem, reported with its key
            said: list[str] = []
            job.status[i] = not self._refetched(job.raw, i, job.positions, job.epoch, job.pixels[i], e, said, shards)
            job.failures[i] = said[-1] if said else None

    def _rng(self, job: _Job, i: int) -> SampleRng | None:
        if job.states is not None:
            return SampleRng.at(job.states[i])
        return self.rngs(job.epoch, job.positions[i : i + 1])[0]  # chunked (see begin), or val: None

    def end(self, job: _Job) -> HostBatch:
        """The batch, its labels and ids as numpy arrays (HostBatch.tensors makes them tensors in the training
        thread)."""
        start, raw, buffer, n = time.perf_counter(), job.raw, job.buffer, len(job.raw)
        if not any(job.status):  # the common case, in few Python steps (they hold the GIL)
            images = buffer if n == len(buffer) else buffer[:n]
            batch = HostBatch(raw.labels, raw.ids, images=images, skipped=[], slot=job.slot)
            batch.stages = {"read": raw.read_s, "decode": sum(job.decode_s), "assemble": time.perf_counter() - start}
            return batch
        good, skipped = [i for i in range(n) if not job.status[i]], [f for f in job.failures if f]
        pick = self._fill(good, n, skipped[-1] if skipped else "") if self.train else good
        if pick != list(range(n)):
            buffer[: len(pick)] = buffer[pick]  # the index copies first
        batch = HostBatch(raw.labels[pick], raw.ids[pick], images=buffer[: len(pick)], skipped=skipped, slot=job.slot)
        batch.stages = {"read": raw.read_s, "decode": sum(job.decode_s), "assemble": time.perf_counter() - start}
        return batch

    def _refetched(self, raw: RawBatch, i: int, positions, epoch: int, out, error: Exception, skipped,
                   shards=None) -> bool:
        """Remote data: a sample that does not decode is fetched once more from the store and decoded again with the
        same draws (the node cache's copy may be what is damaged); True when that worked, else it is bad."""
        again = (shards or raw.shards).refetch(int(raw.ids[i]))
        if again is not None:
            try:
                self._decode(again[0], self.rngs(epoch, positions[i : i + 1])[0], out)
                raw.labels[i] = again[1]
                return True
            except Exception as e:
                error = e
        self._bad(raw, i, error, skipped)
        return False

    def _decode(self, image, rng, out) -> None:
        cfg = self.cfg
        if self.train:
            cpu_ops.decode_train(image, cfg.image_size, rng, cfg.min_scale, cfg.cpu_decoder, out, self.max_pixels)
        else:
            cpu_ops.decode_val(image, cfg.image_size, cfg.val_crop, cfg.cpu_decoder, out, self.max_pixels)


class EncodedBytes(_Prepare):
    def __call__(self, raw: RawBatch, positions, epoch: int) -> HostBatch:
        start, cfg, keep, boxes, flips, skipped = time.perf_counter(), self.cfg, [], [], [], []
        for i, (image, rng) in enumerate(zip(raw.images, self.rngs(epoch, positions))):
            try:
                w, h = cpu_ops.jpeg_size(image, self.max_pixels)
            except Exception as e:
                self._bad(raw, i, e, skipped)
                continue
            if self.train:
                box, flip = cpu_ops.draw_train_params(w, h, rng, cfg.min_scale)
            else:
                box, flip = cpu_ops.center_crop_box(w, h, cfg.image_size, cfg.val_crop), False
            keep.append(i)
            boxes.append(box)
            flips.append(flip)
        if self.train and len(keep) < len(raw):  # keep the batch shape with copies of good samples
            pick = self._fill(list(range(len(keep))), len(raw), skipped[-1] if skipped else "")
            keep, boxes, flips = [keep[i] for i in pick], [boxes[i] for i in pick], [flips[i] for i in pick]
        return HostBatch(raw.labels[keep], raw.ids[keep],
                         data=[torch.frombuffer(bytearray(raw.images[i]), dtype=torch.uint8) for i in keep],
                         boxes=torch.tensor(boxes, dtype=torch.int64).reshape(-1, 4),
                         flips=torch.tensor(flips, dtype=torch.bool), skipped=skipped,
                         stages={"read": raw.read_s, "headers": time.perf_counter() - start})


class Raw(_Prepare):
    def __call__(self, raw: RawBatch, positions, epoch: int) -> HostBatch:
        return HostBatch(raw.labels, raw.ids, data=[np.frombuffer(im, np.uint8) for im in raw.images],
                         stages={"read": raw.read_s})

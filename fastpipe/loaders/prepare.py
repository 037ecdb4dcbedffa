"""What each backend does on the host with a batch of raw samples, in the loader workers.

- CpuDecode (torch backend): decode + random-resized-crop + flip (train) or resize + centre crop (val) into a
  pooled uint8 batch buffer.
- EncodedBytes (nvjpeg): the JPEG bytes, and each sample's crop box and flip drawn from its header (the same draws
  as CpuDecode), for decoding on the device.
- Raw (DALI): the JPEG bytes as numpy arrays, for DALI's external source.

A sample that fails to decode is named with its shard and key. In train batches it is replaced by a copy of a good
sample of the same batch, so every batch keeps its shape (static shapes for torch.compile, no tiny batch for
BatchNorm); in val batches it is left out, so accuracy never counts an image twice. With on_error="raise" the
batch stops with the sample's name instead.
"""

from __future__ import annotations

import numpy as np
import torch

from fastpipe.errors import DataError
from fastpipe.loaders import cpu_ops
from fastpipe.loaders.batch import BufferPool, HostBatch
from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.rng import SampleRng
from fastpipe.loaders.shards import RawSample


class SampleError(DataError):
    """A sample that can't be decoded (with on_error="raise"), or a batch none of whose samples decode."""


def label_tensor(labels: list, num_classes: int, multilabel: bool) -> torch.Tensor:
    """int64 class indices, or for multi-label data float32 multi-hot rows (N, K)."""
    if not multilabel:
        return torch.tensor(labels, dtype=torch.int64)
    hot = torch.zeros((len(labels), num_classes), dtype=torch.float32)
    for row, ks in enumerate(labels):
        hot[row, list(ks)] = 1.0
    return hot


def _failure(s: RawSample, e: Exception) -> str:
    return f"sample {s.key} in shard {s.shard}: {type(e).__name__}: {str(e)[:200]}"


class _Prepare:
    def __init__(self, cfg: LoaderConfig, num_classes: int, multilabel: bool = False):
        self.cfg, self.train = cfg, cfg.split == "train"
        self.num_classes, self.multilabel = num_classes, multilabel

    def labels(self, samples: list[RawSample]) -> torch.Tensor:
        return label_tensor([s.label for s in samples], self.num_classes, self.multilabel)

    def rng(self, epoch: int, position: int) -> SampleRng:
        return SampleRng(self.cfg.seed, epoch, position)

    def _bad(self, s: RawSample, e: Exception, skipped: list[str]) -> None:
        if self.cfg.on_error == "raise":
            raise SampleError(_failure(s, e)) from e
        skipped.append(_failure(s, e))

    @staticmethod
    def _fill(good: list[int], n: int, what: str) -> list[int]:
        """Index of the sample whose copy fills each place of a train batch (itself when it decoded)."""
        if not good:
            raise SampleError(f"none of the {n} samples of a batch decodes ({what}): the shards are damaged; "
                              f"run `fastpipe inspect --verify`")
        ok = set(good)
        return [i if i in ok else good[i % len(good)] for i in range(n)]


class CpuDecode(_Prepare):
    def __init__(self, cfg: LoaderConfig, num_classes: int, multilabel: bool, buffers: BufferPool):
        super().__init__(cfg, num_classes, multilabel)
        self.buffers = buffers

    def __call__(self, samples: list[RawSample], positions, epoch: int) -> HostBatch:
        cfg = self.cfg
        buffer, slot = self.buffers.take()
        good, skipped = [], []
        for i, (s, pos) in enumerate(zip(samples, positions)):
            out = buffer[i].numpy()  # decoded straight into the batch
            try:
                if self.train:
                    cpu_ops.decode_train(s.image, cfg.image_size, self.rng(epoch, pos), cfg.min_scale,
                                         cfg.cpu_decoder, out)
                else:
                    cpu_ops.decode_val(s.image, cfg.image_size, cfg.val_crop, cfg.cpu_decoder, out)
                good.append(i)
            except Exception as e:  # any decoder failure is this sample's problem, reported with its key
                self._bad(s, e, skipped)
        pick = self._fill(good, len(samples), skipped[-1] if skipped else "") if self.train else good
        if pick != list(range(len(samples))):
            buffer[: len(pick)] = buffer[pick].clone()
        ids = torch.tensor([samples[i].id for i in pick], dtype=torch.int64)
        return HostBatch(self.labels([samples[i] for i in pick]), ids, images=buffer[: len(pick)], skipped=skipped,
                         slot=slot)


class EncodedBytes(_Prepare):
    def __call__(self, samples: list[RawSample], positions, epoch: int) -> HostBatch:
        cfg, keep, boxes, flips, skipped = self.cfg, [], [], [], []
        for s, pos in zip(samples, positions):
            try:
                w, h = cpu_ops.jpeg_size(s.image)
            except Exception as e:
                self._bad(s, e, skipped)
                continue
            if self.train:
                box, flip = cpu_ops.draw_train_params(w, h, self.rng(epoch, pos), cfg.min_scale)
            else:
                box, flip = cpu_ops.center_crop_box(w, h, cfg.image_size, cfg.val_crop), False
            keep.append(s)
            boxes.append(box)
            flips.append(flip)
        if self.train and len(keep) < len(samples):  # keep the batch shape with copies of good samples
            pick = self._fill(list(range(len(keep))), len(samples), skipped[-1] if skipped else "")
            keep, boxes, flips = [keep[i] for i in pick], [boxes[i] for i in pick], [flips[i] for i in pick]
        return HostBatch(self.labels(keep), torch.tensor([s.id for s in keep], dtype=torch.int64),
                         data=[torch.frombuffer(bytearray(s.image), dtype=torch.uint8) for s in keep],
                         boxes=torch.tensor(boxes, dtype=torch.int64).reshape(-1, 4),
                         flips=torch.tensor(flips, dtype=torch.bool), skipped=skipped)


class Raw(_Prepare):
    def __call__(self, samples: list[RawSample], positions, epoch: int) -> HostBatch:
        return HostBatch(self.labels(samples), torch.tensor([s.id for s in samples], dtype=torch.int64),
                         data=[np.frombuffer(s.image, dtype=np.uint8) for s in samples])

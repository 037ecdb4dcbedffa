"""dali backend: NVIDIA DALI reads the shards with `fn.readers.webdataset` and the converter's `.idx` files.

On a GPU: nvJPEG decode (`device="mixed"`, the hardware decoder where the GPU has one) fused with the random
crop in train mode, then resize and crop-mirror on the GPU. Without a GPU the same graph runs CPU-only
(`device_id=None`), which is how CI tests it. DALI hands over uint8 HWC; the shared device step (base.py)
makes it channels_last NCHW and normalises, as for every backend.

Differences from the torch backend, by DALI's design:
- train: the reader is an endless shuffled stream and each epoch is the next len(loader) x batch_size
  samples of it, so set_epoch(e) does not select the e-th order (the sequence is still fixed by the seed).
  Val follows the epoch rule exactly (DALI shards by the same contiguous ranges); a rank whose part is one
  batch shorter yields an empty last batch, so that every rank yields len(loader) batches.
- balance=True feeds DALI through `fn.external_source` from the torch backend's planned, class-balanced
  sample stream (reading bytes only; decoding stays in DALI), because DALI's reader has no sampling weights.
- A sample DALI cannot decode stops the epoch with an error (DALI has no skip); `fastpipe inspect --verify`
  finds it, and the torch and nvjpeg backends skip such samples.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from fastpipe.errors import DataError
from fastpipe.loaders.base import Loader
from fastpipe.loaders.shards import ShardSet
from fastpipe.util import usable_cores

INSTALL_HINT = ("the dali backend needs NVIDIA DALI: pip install 'fastpipe[dali]' (CUDA 12 torch) or "
                "'fastpipe[dali-cu13]' (CUDA 13 torch), or use backend='nvjpeg' for GPU decoding without DALI")


def _import_dali():
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e


def _ascii_labels(padded: torch.Tensor) -> torch.Tensor:
    """Zero-padded ASCII digits (N, k) → int64 (N,), vectorised: foreign shards carry only `.cls` text."""
    digits = padded.long() - 48
    valid = padded > 0
    n_digits = valid.sum(1, keepdim=True)
    pos = n_digits - 1 - torch.arange(padded.shape[1], device=padded.device)
    return (torch.where(valid, digits * torch.pow(10, pos.clamp(min=0)), 0)).sum(1)


def _graph(jpegs, cfg, gpu: bool):
    from nvidia.dali import fn, types

    decode_device = "mixed" if gpu else "cpu"
    size = cfg.image_size
    if cfg.split == "train":
        images = fn.decoders.image_random_crop(jpegs, device=decode_device, output_type=types.RGB,
                                               random_area=[cfg.min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                               num_attempts=10, seed=cfg.seed)
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        mirror = fn.random.coin_flip(probability=0.5, seed=cfg.seed + 1)
    else:
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)
        images = fn.resize(images, resize_shorter=size / cfg.val_crop, interp_type=types.INTERP_LINEAR,
                           antialias=True)
        mirror = 0
    return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="HWC", crop=(size, size),
                                    mirror=mirror)


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if "failure" in ln or "rror" in ln]
    return (lines[-1] if lines else str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]


def _first_undecodable(shards: ShardSet, seconds: float) -> str | None:
    """'shard X, sample K' of the first sample the CPU decoder rejects, looking for at most `seconds`."""
    import time

    from fastpipe.loaders.cpu_ops import decode_val
    from fastpipe.loaders.epoch import Piece

    deadline = time.perf_counter() + seconds
    for i, n in enumerate(shards.counts):
        for s in shards.read(Piece(i, 0, n)):
            try:
                decode_val(s.image, 32)
            except Exception:
                return f"shard {s.shard}, sample {s.key} is undecodable"
            if time.perf_counter() > deadline:
                return None
    return None


class DaliLoader(Loader):
    name = "dali"

    def __init__(self, manifest, cfg):
        _import_dali()
        super().__init__(manifest, cfg)
        if self.cfg.balance and self.cfg.split != "train":
            self.cfg = replace(self.cfg, balance=False)
        self.shards = ShardSet(manifest, self.cfg.split)
        self.gpu = self.device.type == "cuda"
        self.threads = self.cfg.num_workers or usable_cores()
        self.ascii_labels = manifest.components.label_bin is None
        self._iterator = None

    def describe(self) -> dict:
        return {**super().describe(), "dali_threads": self.threads, "decode": "mixed (GPU)" if self.gpu else "cpu"}

    def _reader(self):
        from nvidia.dali import fn, types

        train = self.cfg.split == "train"
        label_ext = self.manifest.components.label if self.ascii_labels else self.manifest.components.label_bin
        jpegs, labels = fn.readers.webdataset(
            paths=[str(p) for p in self.shards.paths], index_paths=[str(p) for p in self.shards.index_paths],
            ext=[self.manifest.components.image, label_ext],
            dtypes=[types.UINT8, types.UINT8 if self.ascii_labels else types.INT32],
            random_shuffle=train, initial_fill=max(self.cfg.shuffle_buffer, 1), seed=self.cfg.seed,
            shard_id=self.cfg.rank, num_shards=self.cfg.world_size, pad_last_batch=not train,
            missing_component_behavior="error", name="reader")
        if self.ascii_labels:
            labels = fn.pad(labels, fill_value=0, shape=[12])
        return jpegs, labels

    def _balanced_source(self):
        """Batches of (JPEG bytes, label) from the torch backend's class-balanced stream, endlessly."""
        from fastpipe.loaders.torch_wds import SampleStream

        stream = SampleStream(self.shards, self.cfg, self.manifest.class_weights(), mode="raw")
        epoch = self.epoch
        while True:
            stream.epoch[0] = epoch
            for images, labels, _ in stream:
                yield images, labels
            epoch += 1

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        @pipeline_def(batch_size=self.cfg.batch_size, num_threads=self.threads,
                      device_id=(self.device.index or 0) if self.gpu else None, seed=self.cfg.seed,
                      prefetch_queue_depth=2)
        def pipe():
            if self.cfg.balance:
                jpegs, labels = fn.external_source(source=self._balanced_source(), num_outputs=2, batch=True,
                                                   dtype=[types.UINT8, types.INT32])
            else:
                jpegs, labels = self._reader()
            images = _graph(jpegs, self.cfg, self.gpu)
            return images, labels.gpu() if self.gpu else labels

        p = pipe()
        p.build()
        if self.cfg.split == "train":
            # `size` on purpose: each epoch is the next len(loader) batches of the endless shuffled stream, so
            # every rank yields the same count; DALI's warning about sharding does not apply to that use.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Please set `reader_name`")
                return DALIGenericIterator([p], ["images", "labels"], size=self.batches * self.cfg.batch_size,
                                           last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
        return DALIGenericIterator([p], ["images", "labels"], reader_name="reader",
                                   last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def _labels(self, labels: torch.Tensor) -> torch.Tensor:
        return _ascii_labels(labels) if self.ascii_labels else labels.reshape(-1).long()

    def _host_batches(self):
        if self._iterator is None:
            self._iterator = self._build()
        n = 0
        try:
            for out in self._iterator:
                images, labels = out[0]["images"], self._labels(out[0]["labels"])
                yield images, labels, 0
                n += 1
        except RuntimeError as e:
            raise self._explain(e) from e
        size = self.cfg.image_size
        for _ in range(self.batches - n):  # val: a rank with one batch less yields an empty one
            yield torch.empty((0, size, size, 3), dtype=torch.uint8), torch.empty(0, dtype=torch.int64), 0

    def _explain(self, e: RuntimeError) -> DataError:
        """DALI's decode errors name no sample and it cannot skip one: find the culprit (a bounded scan with the
        torch backend's decoder) and give the one-time repair."""
        found = _first_undecodable(self.shards, seconds=20.0)
        where = f" ({found})" if found else ""
        return DataError(f"DALI failed while reading the {self.cfg.split} shards of {self.manifest.root}{where}: "
                         f"{_first_line(e)}. DALI cannot skip an undecodable sample: run `fastpipe inspect "
                         f"{self.manifest.root} --verify --repair` once (it leaves such samples out of the .idx "
                         f"files DALI reads; the shards stay as they are), or use --backend torch or nvjpeg, which "
                         f"skip and count them")

    def _to_device(self, batch):
        images, labels, skipped = batch
        return self.step.images(images), self.step.labels(labels), skipped


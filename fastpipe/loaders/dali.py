"""dali backend: NVIDIA DALI decodes, crops and resizes; fastpipe's sample stream feeds it.

On a GPU: nvJPEG decode (`device="mixed"`, the hardware decoder where the GPU has one) fused with the random crop
in train mode, then resize and crop-mirror on the GPU. Without a GPU the same graph runs CPU-only
(`device_id=None`), which is how CI tests it. DALI hands over uint8 HWC; the shared device step (base.py) makes it
channels_last NCHW and normalises, as for every backend.

The JPEG bytes come through `fn.external_source` from the same planned stream as the other backends (epoch.py,
read in this process: a memory-map slice per sample), not from DALI's own tar reader. So the DALI backend has the
same epoch rule, order, class balancing, sample keys and resumable state as torch and nvjpeg; only the random crop
is DALI's own (seeded, but not the per-sample draws of the other backends). The `.idx` files stay DALI's format,
for pipelines of your own.

DALI cannot skip a sample it fails to decode: the epoch stops with the sample's name and the one-time repair
(`fastpipe inspect OUT --verify --repair`, which leaves such samples out of the .idx files).
"""

from __future__ import annotations

import collections
import time

import numpy as np
import torch

from fastpipe.errors import DataError, MissingDependency
from fastpipe.loaders.base import Loader
from fastpipe.loaders.batch import HostBatch
from fastpipe.loaders.epoch import Piece
from fastpipe.loaders.prepare import Raw
from fastpipe.loaders.shards import ShardSet
from fastpipe.loaders.stream import SampleStream, train_order
from fastpipe.util import usable_cores

INSTALL_HINT = ("the dali backend needs NVIDIA DALI: pip install 'fastpipe[dali]' (CUDA 12 torch) or "
                "'fastpipe[dali-cu13]' (CUDA 13 torch), or use backend='nvjpeg' for GPU decoding without DALI")
EXTRAS = {"12": "fastpipe[dali]", "13": "fastpipe[dali-cu13]"}  # the DALI build for each CUDA major version


def install_command(cuda: str | None = None) -> str:
    """The pip command that installs the DALI build for this torch's CUDA (`cuda`: torch.version.cuda by default);
    both, named, for a CPU-only torch or a CUDA version without one."""
    major = str(cuda or torch.version.cuda or "").split(".")[0]
    if major in EXTRAS:
        return f"pip install '{EXTRAS[major]}'"
    return "pip install 'fastpipe[dali]' (CUDA 12) or 'fastpipe[dali-cu13]' (CUDA 13)"


def _import_dali():
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        raise MissingDependency(INSTALL_HINT) from e


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


class _Feed:
    """DALI's external source: DALI calls iter() on it when built and after every reset, and reads batches ahead;
    the ids of what it read wait in `pending` until their decoded batch comes out (in the same order)."""

    def __init__(self, loader: DaliLoader):
        self.loader, self.pending, self.empty = loader, collections.deque(), 0
        self.io = np.zeros(3, np.int64)  # remote data: requests, bytes, retries since the last batch out

    def take_io(self) -> tuple[int, int, int]:
        io, self.io = tuple(self.io.tolist()), np.zeros(3, np.int64)
        return io

    def __iter__(self):
        self.empty = 0
        for batch in self.loader.stream:
            if batch.error:
                raise DataError(batch.error)
            if not len(batch.ids):  # val: a rank's part one batch short; DALI cannot run an empty batch
                self.empty += 1
                continue
            self.pending.append(batch.ids)
            if batch.io:
                self.io += batch.io
            # Labels as DALI takes them: an int32 per sample, or a multi-hot uint8 row for multi-label data (a worker
            # thread's are numpy arrays, a worker process's tensors)
            labels = np.asarray(batch.labels)
            if self.loader.manifest.multilabel:
                yield batch.data, list(labels.astype("uint8"))
            else:
                yield batch.data, list(labels.astype("int32").reshape(-1, 1))


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if "failure" in ln or "rror" in ln]
    return (lines[-1] if lines else str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]


def _first_undecodable(shards: ShardSet, seconds: float) -> str | None:
    """'shard X, sample K' of the first sample the CPU decoder rejects, looking for at most `seconds`."""
    from fastpipe.loaders.cpu_ops import decode_val

    deadline = time.perf_counter() + seconds
    for i, n in enumerate(shards.counts):
        for s in shards.read_piece(Piece(i, 0, n)):
            try:
                decode_val(s.image, 32)
            except Exception:
                return f"shard {s.shard}, sample {s.key} is undecodable"
            if time.perf_counter() > deadline:
                return None
    return None


class DaliLoader(Loader):
    name = "dali"
    unsupported = ("cpu_decoder", "threads")  # DALI runs its own threads (num_workers of them)

    def __init__(self, manifest, cfg):
        _import_dali()
        super().__init__(manifest, cfg)
        self.shards = ShardSet(manifest, self.cfg.split)
        order = train_order(self.shards, self.cfg, manifest) if self.cfg.split == "train" else None
        self.stream = SampleStream(self.shards, self.cfg, Raw(self.cfg, self.num_classes, manifest.multilabel),
                                   order)
        self.gpu = self.device.type == "cuda"
        self.threads = self.cfg.num_workers if isinstance(self.cfg.num_workers, int) and self.cfg.num_workers \
            else usable_cores()
        self._pipe, self._feed, self._exhausted = None, None, False

    def describe(self) -> dict:
        return {**super().describe(), "dali_threads": self.threads, "decode": "mixed (GPU)" if self.gpu else "cpu"}

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        feed, multi = _Feed(self), self.manifest.multilabel

        @pipeline_def(batch_size=self.cfg.batch_size, num_threads=self.threads,
                      device_id=(self.device.index or 0) if self.gpu else None, seed=self.cfg.seed,
                      prefetch_queue_depth=2)
        def pipe():
            jpegs, labels = fn.external_source(source=feed, num_outputs=2, batch=True, cycle="raise",
                                               dtype=[types.UINT8, types.UINT8 if multi else types.INT32])
            return _graph(jpegs, self.cfg, self.gpu), labels

        p = pipe()
        p.build()
        return p, feed

    def _position_pipeline(self):
        """A pipeline positioned at this epoch: reset when the last epoch ran to its end, else built anew (a
        pipeline stopped half-way holds batches read ahead from the old position)."""
        self.stream.epoch[0], self.stream.position[0] = self.epoch, self.position
        if self._pipe is not None and self._exhausted:
            self._pipe.reset()
            self._feed.pending.clear()
        else:
            self._pipe = self._feed = None  # the old one goes before the new one claims the threads
            self._pipe, self._feed = self._build()
        self._exhausted = False

    def _host_batches(self):
        from nvidia.dali.plugin.pytorch import feed_ndarray

        self._position_pipeline()
        while True:
            try:
                images, labels = self._pipe.run()
            except StopIteration:
                self._exhausted = True
                size = self.cfg.image_size
                for _ in range(self._feed.empty):
                    yield HostBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                    images=torch.empty((0, size, size, 3), dtype=torch.uint8))
                return
            except RuntimeError as e:
                self._pipe = None
                raise self._explain(e) from e
            t = images.as_tensor()
            out = torch.empty(t.shape(), dtype=torch.uint8, device=self.device if self.gpu else "cpu")
            feed_ndarray(t, out, cuda_stream=torch.cuda.current_stream(self.device) if self.gpu else None)
            y = labels.as_array()
            y = torch.from_numpy(y.astype("float32") if self.manifest.multilabel else y.reshape(-1).astype("int64"))
            yield HostBatch(y, self._feed.pending.popleft(), images=out, io=self._feed.take_io())

    def _explain(self, e: RuntimeError) -> DataError:
        """DALI's decode errors name no sample and it cannot skip one: find the culprit (a bounded scan with the
        torch backend's decoder) and give the one-time repair."""
        found = _first_undecodable(self.shards, seconds=20.0)
        where = f" ({found})" if found else ""
        return DataError(f"DALI failed while reading the {self.cfg.split} shards of {self.manifest.location}{where}: "
                         f"{_first_line(e)}. DALI cannot skip an undecodable sample: run `fastpipe inspect "
                         f"{self.manifest.location} --verify --repair` once (it leaves such samples out of the .idx "
                         f"files; the shards stay as they are), or use --backend torch or nvjpeg, which "
                         f"skip and count them")

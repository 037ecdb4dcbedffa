"""The loader contract, and the one device step every backend shares.

Contract: `len(loader)` batches per epoch on every rank (epoch.py), `set_epoch(e)`, and iteration yielding
`(images, labels)` on the configured device: images NCHW in channels_last memory format, float normalised
with the data set's own mean/std (or uint8 when normalize=False); labels int64. `loader.stats` describes the
last epoch.

Host batches travel as uint8 NHWC (4x less traffic than float32), pinned, copied non-blocking on a side CUDA
stream one batch ahead, and turned into normalised floats on the device (timm's PrefetchLoader idea).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.epoch import batches_per_epoch
from fastpipe.manifest import Manifest


@dataclass
class LoaderStats:
    epoch: int = 0
    batches: int = 0
    samples: int = 0
    skipped: int = 0  # samples that failed to decode and were left out (on_error="skip")
    wait_s: float = 0.0  # time the consumer spent blocked waiting for the next batch
    seconds: float = 0.0  # wall time of the epoch's iteration

    def as_dict(self) -> dict:
        return asdict(self)


class DeviceStep:
    """uint8 NHWC host batch → NCHW channels_last on the device; normalised float or uint8."""

    def __init__(self, device: torch.device, mean, std, normalize: bool):
        self.device, self.normalize = device, normalize
        # Scaled by 255 so that the uint8 input is normalised in one subtract and one divide. A channel that never
        # varies (std 0: a synthetic set, one grey image) would divide by zero: at least one grey level.
        self.mean = torch.tensor(mean, device=device, dtype=torch.float32).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device, dtype=torch.float32).view(1, 3, 1, 1).clamp(min=1 / 255) * 255

    def images(self, nhwc: torch.Tensor) -> torch.Tensor:
        x = nhwc.to(self.device, non_blocking=True).permute(0, 3, 1, 2)  # NCHW view = channels_last
        return self.finish(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """NCHW uint8 or float 0..255 on the device → the contract's output."""
        x = x.contiguous(memory_format=torch.channels_last)
        if not self.normalize:
            return x if x.dtype == torch.uint8 else x.round_().clamp_(0, 255).to(torch.uint8)
        return x.float().sub_(self.mean).div_(self.std)

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        return y.to(self.device, non_blocking=True).long()


def _warn_upscaling(manifest: Manifest, cfg: LoaderConfig) -> None:
    stored = manifest.settings.get("short_side")
    if stored and cfg.image_size > stored:
        warnings.warn(f"image_size {cfg.image_size} is larger than the stored short side ({stored} px): every "
                      f"image is upscaled, which adds no detail. Use image_size <= {stored}, or re-shard with "
                      f"--short-side {int(cfg.image_size * 1.15)}", stacklevel=3)


class Loader:
    """Base of the backends: they implement `_host_batches()` and, where needed, `_to_device(batch)`."""

    name = "base"

    def __init__(self, manifest: Manifest, cfg: LoaderConfig):
        self.cfg = cfg.resolved()
        self.manifest = manifest
        self.device = torch.device(self.cfg.device)
        self.samples = manifest.split(self.cfg.split).samples
        self.batches = batches_per_epoch(self.cfg.split, self.samples, self.cfg.batch_size, self.cfg.world_size)
        self.epoch = 0
        self.stats = LoaderStats()
        self.step = DeviceStep(self.device, manifest.mean, manifest.std, self.cfg.normalize)
        if self.name != "synthetic":
            _warn_upscaling(manifest, self.cfg)

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_classes(self) -> int:
        return self.manifest.num_classes

    def describe(self) -> dict:
        """The resolved settings, for run folders and benchmark JSON."""
        return {"backend": self.name, **asdict(self.cfg), "batches_per_epoch": self.batches}

    # -- backend hooks -------------------------------------------------------------------------------
    def _host_batches(self) -> Iterator[tuple]:
        """(images uint8 NHWC, labels, skipped) per batch, on the host."""
        raise NotImplementedError

    def _to_device(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor, int]:
        images, labels, skipped = batch
        return self.step.images(images), self.step.labels(labels), skipped

    # -- iteration ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stats = self.stats = LoaderStats(epoch=self.epoch)
        start = time.perf_counter()
        batches = self._prefetched() if self.device.type == "cuda" else map(self._to_device, self._host_batches())
        it = iter(batches)
        while True:
            t = time.perf_counter()
            try:
                x, y, skipped = next(it)
            except StopIteration:
                break
            stats.wait_s += time.perf_counter() - t
            stats.batches += 1
            stats.samples += len(y)
            stats.skipped += skipped
            stats.seconds = time.perf_counter() - start
            yield x, y
        stats.seconds = time.perf_counter() - start
        if stats.batches != self.batches:
            raise RuntimeError(f"{self.name} loader yielded {stats.batches} batches, expected {self.batches}: "
                               f"a bug in fastpipe's epoch rule, please report it")

    def _prefetched(self) -> Iterator[tuple]:
        """Copy and normalise batch i+1 on a side stream while the caller computes on batch i."""
        stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)

        def load(batch):
            with torch.cuda.stream(stream):
                return self._to_device(batch)

        host = iter(self._host_batches())
        nxt = next((load(b) for b in host), None)
        while nxt is not None:
            current.wait_stream(stream)  # no host sync: the compute stream waits for the copy on the GPU
            x, y, skipped = nxt
            x.record_stream(current)  # the side stream's allocation is in use on the compute stream now
            y.record_stream(current)
            nxt = next((load(b) for b in host), None)
            yield x, y, skipped

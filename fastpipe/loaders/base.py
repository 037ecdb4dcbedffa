"""The loader contract, and the one device step every backend shares.

Contract: `len(loader)` batches per epoch on every rank (epoch.py), `set_epoch(e)`, `state_dict()` /
`load_state_dict()` to stop and resume anywhere in an epoch, and iteration yielding `(images, labels)` (plus
`keys` with with_keys=True) on the configured device: images NCHW in channels_last memory format, float normalised
with the data set's own mean/std, ImageNet's or the user's (normalize=), or uint8 (normalize=False); labels int64.
`loader.stats` describes the last epoch.

Host batches travel as uint8 NHWC (4x less traffic than float32), pinned, copied non-blocking on a side CUDA
stream one batch ahead, and turned into normalised floats on the device (timm's PrefetchLoader idea).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict

import torch

from fastpipe.dataset.manifest import Manifest
from fastpipe.errors import ConfigError, DataError, FastpipeWarning
from fastpipe.loaders.batch import HostBatch, SampleKey
from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.epoch import batches_per_epoch
from fastpipe.loaders.stats import LoaderStats, thread_clock
from fastpipe.options import check_number, normalization

MAX_EPOCH = 1_000_000  # a loader state's epoch beyond this is damage, not a long run


class DeviceStep:
    """uint8 NHWC host batch → NCHW channels_last on the device; normalised float or uint8."""

    def __init__(self, device: torch.device, mean, std, normalize: bool, augment=None):
        self.device, self.normalize = device, normalize
        self.augment = augment  # a DeviceAugment (train batches), or None
        self.gen: torch.Generator | None = None  # the current batch's augmentation generator
        # Scaled by 255 so that the uint8 input is normalised in one subtract and one divide. Used as given: the std
        # is at least one grey level already (options.parse_normalize refuses less, options.normalization floors a
        # data set's), so what a run records is what divides.
        self.mean = torch.tensor(mean, device=device, dtype=torch.float32).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device, dtype=torch.float32).view(1, 3, 1, 1) * 255

    def draw(self, key: tuple[int, ...]):
        """Key this batch's augmentation draws (from epoch, position and rank only); the host-side generator that
        the batch-wise mixing uses, or None without augmentation."""
        if self.augment is None:
            return None
        self.gen, host = self.augment.generator(self.device, key)
        return host

    def mix(self, x: torch.Tensor, y: torch.Tensor, host) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixup / cutmix on the finished batch (soft targets), where the spec asks for them."""
        if self.augment is None or not self.augment.spec.mixing:
            return x, y
        return self.augment.mix(x, y, host)

    def images(self, nhwc: torch.Tensor) -> torch.Tensor:
        x = nhwc.to(self.device, non_blocking=True).permute(0, 3, 1, 2)  # NCHW view = channels_last
        return self.finish(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """NCHW uint8 or float 0..255 on the device → the contract's output (augmented, for a train batch)."""
        x = x.contiguous(memory_format=torch.channels_last)
        g = self.gen
        spec = self.augment.spec if self.augment is not None and g is not None else None
        if spec is not None and spec.pixel_ops:
            x = self.augment.pixels(x.float(), g)
        if not self.normalize:
            if spec is not None and spec.erase:
                x = self.augment.erase((x.float() - 127.5) / 64, g) * 64 + 127.5  # noise spread as when normalised
            return x if x.dtype == torch.uint8 else x.round_().clamp_(0, 255).to(torch.uint8)
        x = x.float().sub_(self.mean).div_(self.std)
        if spec is not None and spec.erase:
            x = self.augment.erase(x, g)
        return x

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        """Class indices (int64), or multi-hot float rows for multi-label data."""
        y = y.to(self.device, non_blocking=True)
        return y if y.is_floating_point() else y.long()


def _warn_upscaling(manifest: Manifest, cfg: LoaderConfig) -> None:
    stored = manifest.settings.get("short_side")
    if stored and cfg.image_size > stored:
        warnings.warn(f"image_size {cfg.image_size} is larger than the stored short side ({stored} px): every "
                      f"image is upscaled, which adds no detail. Use image_size <= {stored}, or re-shard with "
                      f"--short-side {int(cfg.image_size * 1.15)}", FastpipeWarning, stacklevel=4)


def _refuse_what_cannot_fit(cfg: LoaderConfig, device: torch.device) -> None:
    """One batch as it reaches the model (float32) must fit the device's memory, or the run would fail after its
    start-up (or swap a CPU machine to a standstill): refused before anything is built."""
    need = cfg.batch_size * 3 * cfg.image_size**2 * (4 + 1)  # the float batch and the uint8 one it comes from
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device} has"
    else:
        import psutil

        have, where = psutil.virtual_memory().available, "this machine has"
    if need > have:
        raise ConfigError(f"batch_size {cfg.batch_size} at image_size {cfg.image_size} needs {need / 2**30:,.1f} GB "
                          f"for one batch of images alone; {where} {have / 2**30:,.1f} GB. Use a smaller image size "
                          f"or batch (with --accum-steps to keep the effective batch)")


class Loader:
    """Base of the backends: they implement `_host_batches()` (HostBatches) and, where needed, `_to_device`."""

    name = "base"
    # LoaderConfig fields this backend does not implement: a non-default value is refused (not silently ignored).
    unsupported: tuple[str, ...] = ()

    def __init__(self, manifest: Manifest, cfg: LoaderConfig):
        self.cfg = cfg.resolved()
        self._refuse_unsupported()
        self.manifest = manifest
        self.device = torch.device(self.cfg.device)
        self.samples = manifest.split(self.cfg.split).samples
        self.batches = batches_per_epoch(self.cfg.split, self.samples, self.cfg.batch_size, self.cfg.world_size)
        self.epoch = 0
        self.position = 0  # train: samples of this epoch's sequence the steps so far consumed (epoch.py)
        self._resume: int | None = None  # a loaded position: where the next iteration starts
        self._complete = False  # the last iteration ran to the end of its epoch
        self.ended: LoaderStats | None = None  # the stats of the last epoch iterated to its end
        self._iterations = 0  # iterations begun: an older one, resumed, is told it was ended
        self.stats = LoaderStats()
        self.normalization = normalization(self.cfg.normalize, manifest.mean, manifest.std)  # None: uint8
        mean, std = self.normalization or (manifest.mean, manifest.std)
        self.step = DeviceStep(self.device, mean, std, bool(self.cfg.normalize), self._augment(manifest))
        self._start = self._batch_index = 0  # where this iteration started; batches moved since (augmentation keys)
        self.shards = None  # the backends that read shards set a ShardSet (keys, sources)
        _refuse_what_cannot_fit(self.cfg, self.device)
        if self.name != "synthetic":
            _warn_upscaling(manifest, self.cfg)

    def _augment(self, manifest: Manifest):
        if not self.cfg.augment or self.cfg.split != "train":
            return None
        from fastpipe.loaders.augment import DeviceAugment, parse

        return DeviceAugment(parse(self.cfg.augment), manifest.num_classes, manifest.multilabel,
                             self.cfg.label_smoothing, self.cfg.seed)

    def _refuse_unsupported(self) -> None:
        default = LoaderConfig()
        bad = [f for f in self.unsupported if getattr(self.cfg, f) != getattr(default, f)]
        if bad:
            what = ", ".join(f"{f}={getattr(self.cfg, f)!r}" for f in bad)
            raise ConfigError(f"the {self.name} backend does not support {what}; leave "
                              f"{'it' if len(bad) == 1 else 'them'} at the default or use another backend")

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume = None  # a loaded position belongs to the loaded epoch only
        self.epoch = epoch

    @property
    def num_classes(self) -> int:
        return self.manifest.num_classes

    def describe(self) -> dict:
        """The resolved settings, for run folders and benchmark JSON."""
        mean_std = dict(zip(("mean", "std"), self.normalization)) if self.normalization else None
        return {"backend": self.name, **asdict(self.cfg), "normalization": mean_std, "batches_per_epoch": self.batches}

    # -- resuming -------------------------------------------------------------------------------------------
    def _identity(self) -> dict:
        """What fixes the epoch's order: the data, the split, the seed and the order settings (not the world size,
        workers or batch size, which may change on resume)."""
        m = self.manifest
        shards = [(s.path, s.samples, s.sha256) for s in m.split(self.cfg.split).shards]
        data = hashlib.sha256(json.dumps([m.settings.get("fingerprint"), shards]).encode()).hexdigest()[:16]
        return {"data": data, "split": self.cfg.split, "seed": self.cfg.seed, "balance": self.cfg.balance,
                "shuffle_buffer": self.cfg.shuffle_buffer}

    def state_dict(self) -> dict:
        """Where to go on from: small and JSON-able. After a complete epoch, the start of the next one."""
        if self._complete:
            return {"epoch": self.epoch + 1, "position": 0, **self._identity()}
        return {"epoch": self.epoch, "position": self.position, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken (also with another world size, worker count or batch size).
        A state that is not one (a missing key, an epoch of 1.7, NaN or 10**30) is refused naming the field."""
        if not isinstance(state, dict):
            raise ConfigError(f"loader state: expected the dict that state_dict() returns, got {type(state).__name__}")
        missing = [k for k in ("epoch", "position", *self._identity()) if k not in state]
        if missing:
            raise ConfigError(f"loader state: no {', '.join(missing)} (not a state_dict() of a fastpipe loader)")
        epoch = check_number("loader state epoch", state["epoch"], int, 0, MAX_EPOCH)
        position = check_number("loader state position", state["position"], int, 0, self.samples)
        mine = self._identity()
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            what = ", ".join(f"{k}: the state has {old!r}, this loader {new!r}" for k, (old, new) in differ.items())
            raise ConfigError(f"this loader state belongs to another data set or settings ({what})")
        self.epoch, self._resume, self._complete = epoch, position, False

    # -- backend hooks ----------------------------------------------------------------------------------------
    def _host_batches(self) -> Iterator[HostBatch]:
        raise NotImplementedError

    def _to_device(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step.images(batch.images), self.step.labels(batch.labels)

    def _release(self, batch: HostBatch) -> None:
        """The host batch is no longer needed (its device copy or float version exists)."""

    def keys(self, ids: torch.Tensor) -> list[SampleKey]:
        s = self.shards
        return [SampleKey(s.names[int(s.shard_of(i))], s.keys[i], s.source(i), i) for i in ids.tolist()]

    # -- iteration --------------------------------------------------------------------------------------------
    def _expected(self) -> int:
        if self.cfg.split == "train":
            return batches_per_epoch("train", self.samples, self.cfg.batch_size, self.cfg.world_size, self.position)
        return self.batches

    @property
    def batches_left(self) -> int:
        """Batches the next iteration yields: a whole epoch, or its rest after load_state_dict."""
        if self.cfg.split == "train" and self._resume:
            return batches_per_epoch("train", self.samples, self.cfg.batch_size, self.cfg.world_size, self._resume)
        return self.batches

    def _moved(self, batch: HostBatch):
        if batch.error:
            raise DataError(batch.error)
        batch.tensors()
        start, stages = time.perf_counter(), self.stats.stages
        for k, v in (batch.stages or {}).items():
            stages[k] = stages.get(k, 0.0) + v
        host = self.step.draw((self.epoch, self._start + self._batch_index * self.cfg.world_size
                               * self.cfg.batch_size, self.cfg.rank))
        self._batch_index += 1
        x, y = self._to_device(batch)  # may find more undecodable samples (nvjpeg)
        x, y = self.step.mix(x, y, host)
        for s in batch.skipped:
            warnings.warn(f"skipping {s}", FastpipeWarning, stacklevel=4)
        keys = self.keys(batch.ids) if self.cfg.with_keys else None
        if batch.io:
            self.stats.requests += batch.io[0]
            self.stats.fetched_bytes += batch.io[1]
            self.stats.retries += batch.io[2]
        self._release(batch)
        stages["device"] = stages.get("device", 0.0) + time.perf_counter() - start
        return x, y, keys, len(batch.skipped), batch.skipped

    def __iter__(self) -> Iterator[tuple]:
        self.previous = getattr(self, "stats", None)  # the last iteration's, run to its end or not
        stats = self.stats = LoaderStats(epoch=self.epoch)
        self._iterations = mine = self._iterations + 1
        self.position, self._resume, self._complete = self._resume or 0, None, False
        self._start, self._batch_index = self.position, 0
        expected, start = self._expected(), time.perf_counter()
        batches = self._prefetched() if self.device.type == "cuda" else map(self._moved, self._host_batches())
        it = iter(batches)
        step = self.cfg.world_size * self.cfg.batch_size
        while True:
            t = time.perf_counter()
            try:
                x, y, keys, skipped, why = next(it)
            except StopIteration:
                break
            except BaseException:
                self.close()  # an abandoned epoch: worker processes are not left to the garbage collector
                raise
            stats.wait_s += time.perf_counter() - t
            stats.batches += 1
            if stats.batches == max(1, expected // 2):
                stats.half_s, stats.half_batches = time.perf_counter() - start, stats.batches
            stats.samples += len(y)
            stats.skipped += skipped
            stats.skipped_keys += why[: max(0, 20 - len(stats.skipped_keys))]
            stats.seconds = time.perf_counter() - start
            if self.cfg.split == "train":
                self.position += step
            if not getattr(self, "_observe", False):
                yield (x, y, keys) if self.cfg.with_keys else (x, y)
                continue
            (ran, ready), t = thread_clock(), time.perf_counter()  # the step, only while the default looks at it
            yield (x, y, keys) if self.cfg.with_keys else (x, y)
            (ran2, ready2), t2 = thread_clock(), time.perf_counter()
            stats.step_s += max(t2 - t - (ready2 - ready), 0.0)
            stats.step_cpu_s += ran2 - ran
        stats.seconds = time.perf_counter() - start
        if mine != self._iterations:  # its workers were ended when the newer iteration started
            raise RuntimeError(f"this iteration of the {self.name} loader was ended by a newer one (iter(loader) or "
                               f"a for loop over it began again): take batches from the newest iteration only")
        if stats.batches != expected:
            raise RuntimeError(f"{self.name} loader yielded {stats.batches} batches, expected {expected}: "
                               f"a bug in fastpipe's epoch rule, please report it")
        self._complete, self.ended = True, stats

    def close(self) -> None:
        """Release worker processes and pipelines now; the next iteration starts them again."""

    def _prefetched(self) -> Iterator[tuple]:
        """Copy and normalise batch i+1 on a side stream while the caller computes on batch i."""
        stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)

        def load(batch):
            with torch.cuda.stream(stream):
                return self._moved(batch)

        host = iter(self._host_batches())
        nxt = next((load(b) for b in host), None)
        while nxt is not None:
            current.wait_stream(stream)  # no host sync: the compute stream waits for the copy on the GPU
            x, y = nxt[0], nxt[1]
            x.record_stream(current)  # the side stream's allocation is in use on the compute stream now
            y.record_stream(current)
            out, nxt = nxt, next((load(b) for b in host), None)
            yield out

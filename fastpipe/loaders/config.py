"""LoaderConfig: the one place that defines the loaders' settings and their defaults."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fastpipe.errors import ConfigError
from fastpipe.options import MAX_IMAGE_SIZE, SEED_MAX, check_number, is_integer, parse_normalize

SPLITS = ("train", "val")
# (setting, type, low, high, above, below) of each number a loader takes
NUMBERS = (("batch_size", int, 1, 65536), ("image_size", int, 16, MAX_IMAGE_SIZE), ("seed", int, 0, SEED_MAX),
           ("shuffle_buffer", int, 1, 10**9), ("prefetch_factor", int, 1, 64), ("min_scale", float, None, 1, 0),
           ("val_crop", float, None, 1, 0), ("label_smoothing", float, 0, None, None, 1))
ON_ERROR = ("skip", "raise")


@dataclass(frozen=True)
class LoaderConfig:
    backend: str = "torch"  # see fastpipe.loaders.BACKENDS
    split: str = "train"  # train: random-resized-crop + flip, shuffled; val: resize + centre crop, in order
    batch_size: int = 64
    image_size: int = 224
    device: str | None = None  # None: cuda when available, else cpu
    # None: the cores per device, less one when there are more than three, at most 16 (workers.heuristic_workers);
    # "probe": measured once per machine and data set and cached (logged); 0: decode in the training process.
    num_workers: int | str | None = None
    # The workers are threads of the training process (True) or processes (False). None: threads where the decoder
    # releases the GIL (the torch backend's crop decoder, or simplejpeg + OpenCV; every decoder on free-threaded
    # Python), else processes; with num_workers="probe", whichever measured faster. "helper": the threads run in one
    # helper process (no GIL shared with a training step whose Python never pauses). See threads.py.
    threads: bool | str | None = None
    rank: int | None = None  # None: from torch.distributed when initialised, else 0
    world_size: int | None = None
    seed: int = 0
    balance: bool = False  # class-balanced sampling with the manifest's class weights (train only)
    # float, normalised with "dataset" (its own mean/std: right from scratch), "imagenet" (what ImageNet weights were
    # trained with: right for fine-tuning them), or (mean, std) on the 0-1 scale; False: uint8 0..255 (True: dataset)
    normalize: bool | str | tuple = "dataset"
    on_error: str = "skip"  # a sample that fails to decode: skip and count, or raise
    # train: each shuffle block (epoch.py) mixes at least this many samples of at least two shards
    shuffle_buffer: int = 1000
    prefetch_factor: int = 4  # batches queued per worker: absorbs decode-time jitter at ~10 MB a batch
    pin_memory: bool | None = None  # None: on when the device is CUDA
    min_scale: float = 0.08  # RandomResizedCrop's area range lower bound (torchvision's default)
    val_crop: float = 0.875  # val: resize the short side to image_size / val_crop, then centre crop
    # torch backend: "crop" (the C extension + OpenCV), "simplejpeg" (+ OpenCV), "pillow", or auto (crop when built,
    # else simplejpeg; each falls back to the next per file: cpu_ops.py). nvjpeg without a GPU decodes with auto.
    cpu_decoder: str = "auto"
    # No longer needed (accepted, with a DeprecationWarning): the torch backend reuses its batch buffers by default,
    # safely, each once the batch handed out in it has been dropped (loaders/batch.py, BufferPool.lend).
    reuse_output: bool = False
    with_keys: bool = False  # also yield each sample's SampleKey (shard, key, source file), for tracing bad data
    # train: augmentation on the device (augment.py), e.g. "randaug:2:9,mixup:0.2,cutmix:1.0"; val never augments
    augment: str | None = None
    label_smoothing: float = 0.0  # folded into the soft targets when augment mixes (mixup/cutmix)

    def resolved(self) -> LoaderConfig:
        """Fill the None fields from the running process (device, distributed rank)."""
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        rank, world = self.rank, self.world_size
        dist = torch.distributed
        if (rank is None or world is None) and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world = dist.get_world_size() if world is None else world
        cfg = replace(self, device=device, rank=rank or 0, world_size=world or 1,
                      normalize=parse_normalize(self.normalize),  # one form: "dataset", "imagenet", "M:S" or False
                      pin_memory=device.startswith("cuda") if self.pin_memory is None else self.pin_memory)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"split={self.split!r}: use one of {SPLITS}")
        if self.cpu_decoder not in ("auto", "crop", "simplejpeg", "pillow"):
            raise ConfigError(f"cpu_decoder={self.cpu_decoder!r}: use auto, crop, simplejpeg or pillow")
        if self.cpu_decoder == "crop":
            from fastpipe.loaders import jpegcrop

            jpegcrop.require()  # refused here, with the reason and the fix, not in a worker on the first sample
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error={self.on_error!r}: use one of {ON_ERROR}")
        for name, kind, *limits in NUMBERS:  # type, NaN/inf and range, as options.check does for the CLI's configs
            check_number(name, getattr(self, name), kind, *limits)
        for name, low in (("rank", 0), ("world_size", 1)):  # None: from torch.distributed
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), int, low)
        if self.world_size is not None and not 0 <= (self.rank or 0) < self.world_size:
            raise ConfigError(f"rank={self.rank} with world_size={self.world_size}: need 0 <= rank < world_size")
        if self.reuse_output:
            import warnings

            warnings.warn("reuse_output is no longer needed and has no effect: batch buffers are reused by default, "
                          "each once you have dropped the batch in it", DeprecationWarning, stacklevel=4)
        if self.augment:
            from fastpipe.loaders.augment import parse

            parse(self.augment)  # refused here, with the valid forms, before anything is built
        if not isinstance(self.threads, (bool, type(None))) and self.threads != "helper":
            raise ConfigError(f"threads={self.threads!r}: use True (worker threads), False (worker processes), "
                              f"'helper' (threads in one helper process) or None (threads where the decoder releases "
                              f"the GIL)")
        if self.num_workers is not None and self.num_workers != "probe" and (
                not is_integer(self.num_workers) or self.num_workers < 0):
            raise ConfigError(f"num_workers={self.num_workers!r}: use a count >= 0 (not True/False), None (cores per "
                              f"device less one) or 'probe' (measured once and cached)")

"""`fastpipe bench`'s settings: kept apart from the harness so that building the CLI does not import torch."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from fastpipe.loaders import BACKEND_NAMES
from fastpipe.options import (
    MAX_IMAGE_SIZE,
    NORMALIZE_FORMS,
    amp_for,
    check,
    opt,
    parse_normalize,
    parse_onoff,
    parse_threads,
    parse_workers,
)
from fastpipe.store.urls import check_location
from fastpipe.train.config import train_normalize

CPU_BUDGET = 300.0  # seconds for a whole bench on a CPU unless --max-seconds says otherwise


@dataclass(frozen=True)
class BenchConfig:
    data: str = opt(None, "converter output folder, or its URL (s3://, gs://, az://, http(s)://, hf://datasets/...)",
                    positional=True)
    model: str = opt("resnet18", "torchvision model name, or timm:NAME")
    backend: str = opt("torch", "loader backend: " + ", ".join(BACKEND_NAMES), sweep=True, choices=BACKEND_NAMES)
    device: str | None = opt(None, "cuda, cpu (default: cuda when available)")
    batch_size: int = opt(64, "batch size", sweep=True, low=1, high=65536)
    image_size: int = opt(224, "image size", sweep=True, low=16, high=MAX_IMAGE_SIZE)
    amp: str | None = opt(None, "mixed precision (default: fp16 on CUDA, off on a CPU)",
                          choices=("fp16", "bf16", "off"))
    workers: int | str | None = opt(None, "loader workers: a number, auto or probe", sweep=True, parse=parse_workers,
                                    low=0, high=1024)
    threads: bool | str | None = opt(None, "loader workers as threads (on), processes (off), threads in one helper "
                                           "process (helper), or auto (threads where the JPEG decoder releases the "
                                           "GIL)", sweep=True, parse=parse_threads)
    pin_memory: bool | None = opt(None, "pinned host memory: on, off, auto", sweep=True, parse=parse_onoff)
    channels_last: bool | None = opt(None, "channels_last memory format (default: on CUDA)")
    augment: str | None = opt(None, "augmentation on the device, as `fastpipe train --augment` (its share of a "
                                    "step is measured too)")
    normalize: str = opt("dataset", f"input normalisation, as `fastpipe train --normalize`: {NORMALIZE_FORMS}",
                         parse=parse_normalize)
    steps: int = opt(20, "timed steps per window, as far as --max-seconds holds them", low=1, high=1_000_000)
    windows: int = opt(3, "timing windows per measurement (the median is reported); fewer, longer ones when few "
                          "steps fit in --max-seconds", low=1, high=100)
    warmup: int = opt(3, "untimed steps before each measurement", low=0, high=10_000)
    cache_dir: str | None = opt(None, "remote data (s3://, gs://, az://, http(s)://, hf://): this node's shard cache "
                                      "(default ~/.cache/fastpipe/shards or $FASTPIPE_CACHE)")
    cache_limit: str | None = opt(None, "remote data: keep the shard cache under this size, e.g. 50GB "
                                        "(least recently used shards go first; default: no limit)")
    max_seconds: float | None = opt(None, f"time for the whole command, from its start (default: {CPU_BUDGET:.0f} "
                                          f"on a CPU, no limit on CUDA): each measurement gets the steps its figure "
                                          f"needs within it, or nothing is measured and the budget that would do is "
                                          f"named", above=0, high=1e6)

    def __post_init__(self):
        object.__setattr__(self, "normalize", train_normalize(self.normalize))  # its forms in one (a pair: text)
        check(self)
        check_location(self.data)

    def resolved(self) -> BenchConfig:
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        cuda = device.startswith("cuda")
        return replace(self, device=device, amp=amp_for(self.amp, cuda),
                       channels_last=cuda if self.channels_last is None else self.channels_last,
                       max_seconds=self.max_seconds or (None if cuda else CPU_BUDGET))

    def model_key(self) -> tuple:
        """What model-only depends on: rows that share it share one measurement."""
        return self.model, self.device, self.batch_size, self.image_size, self.amp, self.channels_last, self.augment


SWEPT = tuple(f.name for f in fields(BenchConfig) if f.metadata.get("sweep"))


def split_sweep(settings: dict) -> tuple[dict, dict[str, list]]:
    """CLI values → (base settings, {swept field: values}); a swept flag given once is a plain setting."""
    base = {k: v for k, v in settings.items() if k not in SWEPT}
    sweep = {k: v for k, v in settings.items() if k in SWEPT and len(v) > 1}
    base.update({k: v[0] for k, v in settings.items() if k in SWEPT and len(v) == 1})
    return base, sweep

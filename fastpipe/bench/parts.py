"""The real parts `fastpipe bench` times: the training step on a batch already on the device, the loader of a
configuration, and the loaders' device step with and without augmentation. harness.py takes them as factories,
so that the planning and the verdict can be tested with stand-ins whose speed does not depend on the CPU."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fastpipe.bench.config import BenchConfig
from fastpipe.bench.timing import cuda_sync, endless
from fastpipe.loaders import LoaderConfig, make_loader_from
from fastpipe.train.config import TrainConfig
from fastpipe.train.loop import Dist, Trainer, make_optimizer
from fastpipe.train.models import build_model
from fastpipe.util import usable_cores

# BenchConfig's loader settings → LoaderConfig's fields. A setting that changes only the loader goes here (and
# into BenchConfig, swept); it stays out of BenchConfig.model_key, so its rows share one model-only measurement.
LOADER_SETTINGS = {"backend": "backend", "batch_size": "batch_size", "image_size": "image_size", "device": "device",
                   "workers": "num_workers", "threads": "threads", "pin_memory": "pin_memory",
                   "normalize": "normalize"}


@dataclass(frozen=True)
class Model:
    """A training step, step(x, y), and a batch already on the device (synthetic data): what model-only times."""

    step: Callable
    batch: tuple
    sync: Callable[[], None] = lambda: None


def trainer(cfg: BenchConfig, num_classes: int) -> Trainer:
    device = torch.device(cfg.device)
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes, cfg.image_size).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    tc = TrainConfig(data=cfg.data, model=cfg.model, batch_size=cfg.batch_size, lr=1e-3, amp=cfg.amp,
                     optimizer="sgd", device=cfg.device)
    opt_ = make_optimizer(model, tc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_, lambda s: 1.0)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    return Trainer(tc, model, opt_, sched, scaler, nn.CrossEntropyLoss(), device, Dist())


def model(cfg: BenchConfig, manifest) -> Model:
    t = trainer(cfg, manifest.num_classes)
    t.model.train()
    streak = torch.zeros((), dtype=torch.int64, device=t.device)
    synthetic = next(iter(loader(cfg, manifest, "synthetic")))
    return Model(lambda x, y: t.step(x, y, 0, 1, streak), synthetic, cuda_sync(cfg.device))


def loader(cfg: BenchConfig, manifest, backend: str | None = None):
    settings = {field: getattr(cfg, name) for name, field in LOADER_SETTINGS.items()}
    backend = backend or cfg.backend
    lc = LoaderConfig(**{**settings, "backend": backend}, split="train",
                      augment=cfg.augment if backend != "synthetic" else None)
    return make_loader_from(manifest, lc)


def batches(loader_):
    """The loader's batches across epochs, endlessly; close() ends its workers."""
    def epoch(e):
        loader_.set_epoch(e)
        return loader_

    return endless(epoch)


def augment_steps(cfg: BenchConfig, manifest) -> tuple[Callable[[], int], Callable[[], int]]:
    """The loaders' own device step (uint8 batch → normalised, augmented, mixed) on one batch, without and with the
    augmentation: the difference is what the augmentation adds to each step."""
    from fastpipe.loaders.augment import DeviceAugment, parse
    from fastpipe.loaders.base import DeviceStep

    device = torch.device(cfg.device)
    n, size = cfg.batch_size, cfg.image_size
    x = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, device=device)
    y = (torch.rand(n, manifest.num_classes, device=device) < 0.3).float() if manifest.multilabel \
        else torch.randint(0, manifest.num_classes, (n,), device=device)
    aug = DeviceAugment(parse(cfg.augment), manifest.num_classes, manifest.multilabel, 0.1, 0)
    counter = itertools.count()

    def stepper(ds: DeviceStep) -> Callable[[], int]:
        def step():
            host = ds.draw((0, next(counter), 0))
            ds.mix(ds.images(x), ds.labels(y), host)
            return n

        return step

    return (stepper(DeviceStep(device, manifest.mean, manifest.std, True)),
            stepper(DeviceStep(device, manifest.mean, manifest.std, True, aug)))


def machine_info() -> dict:
    import platform

    import torchvision

    info = {"cpus": os.cpu_count(), "usable_cores": usable_cores(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info

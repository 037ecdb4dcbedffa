"""Three measurements of one training setup, and the verdict: is the loader or the device the bottleneck?

1. loader only: the real loader, no model — what the input pipeline delivers, as training receives it;
2. model only: the training step (forward, backward, optimizer) fed by the synthetic backend — the ceiling;
3. end to end: the training step fed by the real loader, with the share of time spent waiting for data.
All three use the same model, batch, image size and precision, warm up first, and read the clock only after
synchronising the device (timing.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from fastpipe.bench.timing import Throughput, cuda_sync, endless, measure
from fastpipe.loaders import LoaderConfig, make_loader_from
from fastpipe.loaders.workers import usable_cores
from fastpipe.manifest import load
from fastpipe.train.config import TrainConfig
from fastpipe.train.loop import Dist, Trainer, make_optimizer
from fastpipe.train.models import build_model

DEVICE_BOUND = 0.90  # end to end within 10 % of the model-only rate: the device is the limit
LOADER_BOUND = 0.85  # end to end at >= 85 % of the loader-only rate, and well below the model: the loader
WAIT_BOUND = 0.5  # ... or half of every step spent waiting for data (a loader in the training process)


@dataclass(frozen=True)
class BenchConfig:
    data: str
    model: str = "resnet18"
    backend: str = "torch"
    device: str | None = None
    batch_size: int = 64
    image_size: int = 224
    amp: str | None = None  # None: fp16 on CUDA, off on CPU (as `fastpipe train`)
    workers: int | None = None  # None: measured and cached by the loader
    pin_memory: bool | None = None
    channels_last: bool | None = None
    steps: int = 20  # timed steps per window
    windows: int = 3
    warmup: int = 3
    max_seconds: float | None = None  # cap per measurement (all windows), for slow CPU setups

    def resolved(self) -> BenchConfig:
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        cuda = device.startswith("cuda")
        return replace(self, device=device, amp=self.amp or ("fp16" if cuda else "off"),
                       channels_last=cuda if self.channels_last is None else self.channels_last)


class Utilisation:
    """CPU % (psutil) and GPU % (NVML through torch, where installed) sampled in the background."""

    def __init__(self, device: str):
        self.device, self.cpu, self.gpu = device, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        psutil.cpu_percent(None)
        while not self._stop.wait(0.2):
            self.cpu.append(psutil.cpu_percent(None))
            if self.device.startswith("cuda"):
                # Without NVML (pynvml) the GPU figure is simply absent.
                with contextlib.suppress(Exception):
                    self.gpu.append(torch.cuda.utilization(torch.device(self.device)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        avg = lambda xs: round(sum(xs) / len(xs), 1) if xs else None  # noqa: E731
        return {"cpu_pct": avg(self.cpu), "gpu_pct": avg(self.gpu)}


def _trainer(cfg: BenchConfig, num_classes: int) -> Trainer:
    device = torch.device(cfg.device)
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes, cfg.image_size).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    tc = TrainConfig(data=cfg.data, model=cfg.model, batch_size=cfg.batch_size, lr=1e-3, amp=cfg.amp,
                     optimizer="sgd", device=cfg.device)
    opt = make_optimizer(model, tc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    return Trainer(tc, model, opt, sched, scaler, nn.CrossEntropyLoss(), device, Dist())


def _loader(cfg: BenchConfig, manifest, backend: str):
    lc = LoaderConfig(backend=backend, split="train", batch_size=cfg.batch_size, image_size=cfg.image_size,
                      device=cfg.device, num_workers=cfg.workers, pin_memory=cfg.pin_memory)
    return make_loader_from(manifest, lc)


def _batches(loader):
    def epoch(e):
        loader.set_epoch(e)
        return loader

    return endless(epoch)


def _measure(cfg: BenchConfig, step) -> tuple[Throughput, dict]:
    with Utilisation(cfg.device) as u:
        t = measure(step, warmup=cfg.warmup, windows=cfg.windows, window_images=cfg.steps * cfg.batch_size,
                    sync=cuda_sync(cfg.device), max_seconds=cfg.max_seconds)
    return t, u.summary()


def run_one(cfg: BenchConfig) -> dict:
    """The three measurements and the verdict for one configuration."""
    cfg = cfg.resolved()
    manifest = load(cfg.data)
    loader = _loader(cfg, manifest, cfg.backend)
    trainer = _trainer(cfg, manifest.num_classes)
    streak = torch.zeros((), dtype=torch.int64, device=trainer.device)
    real = _batches(loader)

    def loader_step():
        x, _ = next(real)
        return len(x)

    loader_only, u1 = _measure(cfg, loader_step)
    x_syn, y_syn = next(iter(_loader(cfg, manifest, "synthetic")))
    trainer.model.train()

    def model_step():
        trainer.step(x_syn, y_syn, 0, 1, streak)
        return len(y_syn)

    model_only, u2 = _measure(cfg, model_step)
    waited = [0.0]

    def e2e_step():
        t = time.perf_counter()
        x, y = next(real)
        waited[0] += time.perf_counter() - t
        trainer.step(x, y, 0, 1, streak)
        return len(y)

    for _ in range(cfg.warmup):
        e2e_step()
    waited[0], start = 0.0, time.perf_counter()
    e2e, u3 = _measure(replace(cfg, warmup=0), e2e_step)
    wait_share = waited[0] / max(time.perf_counter() - start, 1e-9)
    v = verdict(loader_only.img_per_s, model_only.img_per_s, e2e.img_per_s, wait_share)
    result = {"config": asdict(cfg), "loader_workers": getattr(loader, "num_workers", None),
              "loader_only": {**loader_only.as_dict(), **u1}, "model_only": {**model_only.as_dict(), **u2},
              "end_to_end": {**e2e.as_dict(), **u3, "data_wait": wait_share}, **v}
    result["advice"] = advice(result, manifest)
    return result


def verdict(loader_ips: float, model_ips: float, e2e_ips: float, wait_share: float) -> dict:
    """loader-bound / device-bound / balanced, from the three rates."""
    headroom = model_ips / max(loader_ips, 1e-9)
    idle = max(0.0, 1 - e2e_ips / max(model_ips, 1e-9))
    if e2e_ips >= DEVICE_BOUND * model_ips:
        v = "device-bound"
        noise = " (above 100 %: timing noise)" if e2e_ips > 1.02 * model_ips else ""
        words = (f"device-bound: end to end runs at {e2e_ips / model_ips:.0%} of the model-only rate{noise} "
                 f"({e2e_ips:,.0f} of {model_ips:,.0f} img/s); the loader has {1 / headroom:.1f}x headroom")
    elif (e2e_ips >= LOADER_BOUND * loader_ips or wait_share >= WAIT_BOUND) and \
            loader_ips < DEVICE_BOUND * model_ips:
        v = "loader-bound"
        words = (f"loader-bound: end to end {e2e_ips:,.0f} img/s is held by the loader (alone "
                 f"{loader_ips:,.0f} img/s); the device could take {model_ips:,.0f} img/s ({headroom:.1f}x) "
                 f"and sits idle {idle:.0%} of the time ({wait_share:.0%} of each step waits for data)")
    else:
        v = "balanced"
        words = (f"balanced: end to end {e2e_ips:,.0f} img/s, below both the loader ({loader_ips:,.0f}) and the "
                 f"model ({model_ips:,.0f}); they compete (on a CPU: for the same cores), {wait_share:.0%} data wait")
    return {"verdict": v, "verdict_text": words, "headroom": headroom, "device_idle": idle}


def advice(r: dict, manifest) -> list[str]:
    """Concrete next steps from the numbers."""
    c, out = r["config"], []
    cuda = c["device"].startswith("cuda")
    workers = r.get("loader_workers")
    if r["verdict"] in ("loader-bound", "balanced"):
        if workers is not None and workers < usable_cores() and c["backend"] in ("torch", "nvjpeg"):
            out.append(f"more loader workers: {workers} of {usable_cores()} cores in use (--workers)")
        if cuda and c["backend"] == "torch":
            out.append("decode on the GPU: --backend dali (nvJPEG, hardware decoder) or --backend nvjpeg")
        stored = manifest.settings.get("short_side")
        if stored and stored > 1.5 * c["image_size"]:
            out.append(f"store smaller images: re-shard with --short-side {int(c['image_size'] * 1.15)} "
                       f"(now {stored}); decode cost grows with stored pixels")
        if not cuda:
            out.append("on a CPU-only machine decoding and training share the cores: a GPU, or a smaller "
                       "--image-size, is the larger lever")
    if r["verdict"] in ("device-bound", "balanced"):
        if c["amp"] == "off":
            out.append("mixed precision: --amp fp16 on CUDA (bf16 on recent CPUs)" if cuda else
                       "mixed precision: --amp bf16 where the CPU supports it")
        if cuda and not c["channels_last"]:
            out.append("--channels-last: faster convolutions with Tensor Cores")
        if cuda:
            out.append(f"a bigger batch if memory allows: `fastpipe memory --model {c['model']} --image-size "
                       f"{c['image_size']}` shows the largest that fits; --compile can add 10-30 %")
    return out


def grid(cfg: BenchConfig, sweep: dict[str, list]) -> list[BenchConfig]:
    """Every combination of the swept values (keys are BenchConfig fields)."""
    keys = list(sweep)
    return [replace(cfg, **dict(zip(keys, combo))) for combo in itertools.product(*(sweep[k] for k in keys))]


def run_sweep(cfg: BenchConfig, sweep: dict[str, list], on_row=None) -> dict:
    rows = []
    for c in grid(cfg, sweep):
        try:
            row = run_one(c)
        except ImportError as e:  # e.g. DALI not installed: the row says so instead of failing the sweep
            row = {"config": asdict(c.resolved()), "skipped": str(e)}
        rows.append(row)
        if on_row:
            on_row(row)
    done = [r for r in rows if "skipped" not in r]
    best = max(done, key=lambda r: r["end_to_end"]["img_per_s"], default=None)
    return {"rows": rows, "best": best["config"] if best else None, "machine": machine_info(cfg),
            "sweep": {k: [str(x) for x in v] for k, v in sweep.items()}}


def machine_info(cfg: BenchConfig) -> dict:
    import platform

    import torchvision

    info = {"cpus": os.cpu_count(), "usable_cores": usable_cores(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


__all__ = ["BenchConfig", "run_one", "run_sweep", "verdict"]

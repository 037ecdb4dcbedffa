"""Three measurements of one training setup, and the verdict: is the loader or the device the bottleneck?

1. loader only: the real loader, no model — what the input pipeline delivers, as training receives it;
2. model only: the training step (forward, backward, optimizer) fed by the synthetic backend — the ceiling;
   measured once per model setting and shared by every row of a sweep that has it, so rows differ only by loader;
3. end to end: the training step fed by the real loader, with the share of time spent waiting for data.
All three use the same model, batch, image size and precision, warm up first, and read the clock only after
synchronising the device (timing.py). `max_seconds` bounds the whole run: each measurement gets an equal share.
Headroom, everywhere (text, JSON, README): loader-only ÷ model-only, how many times what the model consumes
the loader can deliver (below 1: the loader cannot keep up).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict, replace

import torch
from torch import nn

from fastpipe.bench.config import CPU_BUDGET, SWEPT, BenchConfig, split_sweep  # noqa: F401 (the API)
from fastpipe.bench.timing import Budget, Utilisation, cuda_sync, endless, measure
from fastpipe.loaders import LoaderConfig, make_loader_from
from fastpipe.manifest import load
from fastpipe.train.config import TrainConfig
from fastpipe.train.loop import Dist, Trainer, make_optimizer
from fastpipe.train.models import build_model
from fastpipe.util import usable_cores

DEVICE_BOUND = 0.90  # end to end within 10 % of the model-only rate: the device is the limit
LOADER_BOUND = 0.85  # end to end at >= 85 % of the loader-only rate, and well below the model: the loader
WAIT_BOUND = 0.5  # ... or half of every step spent waiting for data (a loader in the training process)
WAIT_FREE = 0.1  # under a tenth of each step waiting: the loader is not what holds training back


def _trainer(cfg: BenchConfig, num_classes: int) -> Trainer:
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


def _loader(cfg: BenchConfig, manifest, backend: str):
    lc = LoaderConfig(backend=backend, split="train", batch_size=cfg.batch_size, image_size=cfg.image_size,
                      device=cfg.device, num_workers=cfg.workers, pin_memory=cfg.pin_memory,
                      augment=cfg.augment if backend != "synthetic" else None)
    return make_loader_from(manifest, lc)


def _batches(loader):
    def epoch(e):
        loader.set_epoch(e)
        return loader

    return endless(epoch)


def _measure(cfg: BenchConfig, step, seconds: float | None) -> dict:
    with Utilisation(cfg.device) as u:
        t = measure(step, warmup=cfg.warmup, windows=cfg.windows, window_images=cfg.steps * cfg.batch_size,
                    sync=cuda_sync(cfg.device), max_seconds=seconds)
    return {**t.as_dict(), **u.summary()}


def model_only(cfg: BenchConfig, manifest, seconds: float | None) -> dict:
    trainer = _trainer(cfg, manifest.num_classes)
    x, y = next(iter(_loader(cfg, manifest, "synthetic")))
    trainer.model.train()
    streak = torch.zeros((), dtype=torch.int64, device=trainer.device)

    def step():
        trainer.step(x, y, 0, 1, streak)
        return len(y)

    return _measure(cfg, step, seconds)


def augment_only(cfg: BenchConfig, manifest, seconds: float | None) -> dict:
    """What the augmentation adds: the loaders' own device step (uint8 batch → normalised, augmented, mixed) on one
    batch with and without it. `img_per_s` is the rate of the difference alone, so that its time per image divided
    by an end-to-end step's is the augmentation's share of that step."""
    from fastpipe.loaders.augment import DeviceAugment, parse
    from fastpipe.loaders.base import DeviceStep

    device = torch.device(cfg.device)
    n, size = cfg.batch_size, cfg.image_size
    x = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, device=device)
    y = (torch.rand(n, manifest.num_classes, device=device) < 0.3).float() if manifest.multilabel \
        else torch.randint(0, manifest.num_classes, (n,), device=device)
    aug = DeviceAugment(parse(cfg.augment), manifest.num_classes, manifest.multilabel, 0.1, 0)
    counter = itertools.count()

    def timed(ds: DeviceStep) -> dict:
        def step():
            host = ds.draw((0, next(counter), 0))
            ds.mix(ds.images(x), ds.labels(y), host)
            return n

        return _measure(cfg, step, seconds / 2 if seconds else None)

    plain = timed(DeviceStep(device, manifest.mean, manifest.std, True))
    augmented = timed(DeviceStep(device, manifest.mean, manifest.std, True, aug))
    extra = max(1 / augmented["img_per_s"] - 1 / plain["img_per_s"], 1e-12)  # seconds per image; noise can make it < 0
    return {"img_per_s": 1 / extra, "ms_per_batch": extra * n * 1e3, "plain_img_per_s": plain["img_per_s"],
            "augmented_img_per_s": augmented["img_per_s"]}


def loader_and_e2e(cfg: BenchConfig, manifest, seconds: float | None) -> tuple[dict, dict, object]:
    loader = _loader(cfg, manifest, cfg.backend)
    real = _batches(loader)

    def loader_step():
        x, _ = next(real)
        return len(x)

    lo = _measure(cfg, loader_step, seconds)
    trainer = _trainer(cfg, manifest.num_classes)
    streak = torch.zeros((), dtype=torch.int64, device=trainer.device)
    waited = [0.0]

    def e2e_step():
        t = time.perf_counter()
        x, y = next(real)
        waited[0] += time.perf_counter() - t
        trainer.step(x, y, 0, 1, streak)
        return len(y)

    start = time.perf_counter()
    e2e = _measure(cfg, e2e_step, seconds)
    e2e["data_wait"] = waited[0] / max(time.perf_counter() - start, 1e-9)
    return lo, e2e, loader


def verdict(loader_ips: float, model_ips: float, e2e_ips: float, wait_share: float) -> dict:
    """loader-bound / device-bound / balanced, from the three rates and the share of each step spent waiting.

    The wait share decides first: it is the direct measure of a device starved of data, while the rates were
    measured at different moments (noise of +-10 % on a busy machine). Waiting half the time is loader-bound;
    waiting under a tenth is device-bound even if end to end is below model-only (that gap is the machine: on a
    CPU the loader's workers take cores from the model, and noise). headroom = loader / model."""
    headroom = loader_ips / max(model_ips, 1e-9)
    idle = max(0.0, 1 - e2e_ips / max(model_ips, 1e-9))
    ratio = e2e_ips / max(model_ips, 1e-9)
    if wait_share >= WAIT_BOUND or (e2e_ips >= LOADER_BOUND * loader_ips and loader_ips < DEVICE_BOUND * model_ips
                                    and wait_share >= WAIT_FREE):
        v = "loader-bound"
        words = (f"loader-bound: end to end {e2e_ips:,.1f} img/s is held by the loader (alone {loader_ips:,.1f} "
                 f"img/s, {headroom:.2f}x what the model consumes); the device could take {model_ips:,.1f} img/s "
                 f"and sits idle {idle:.0%} of the time ({wait_share:.0%} of each step waits for data)")
    elif wait_share < WAIT_FREE or ratio >= DEVICE_BOUND:
        v = "device-bound"
        gap = "" if ratio >= DEVICE_BOUND else (f"; the {1 - ratio:.0%} below model-only is not waiting for data "
                                                 f"(on a CPU the loader's workers share its cores; or noise)")
        words = (f"device-bound: end to end runs at {ratio:.0%} of the model-only rate ({e2e_ips:,.1f} of "
                 f"{model_ips:,.1f} img/s), {wait_share:.0%} of each step waits for data; the loader delivers "
                 f"{headroom:.1f}x what the model consumes{gap}")
    else:
        v = "balanced"
        words = (f"balanced: end to end {e2e_ips:,.1f} img/s, below both the loader ({loader_ips:,.1f}) and the "
                 f"model ({model_ips:,.1f}); they compete (on a CPU: for the same cores), {wait_share:.0%} data wait")
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
    """Every combination of the swept values (keys are BenchConfig fields), resolved."""
    keys = list(sweep)
    return [replace(cfg, **dict(zip(keys, combo))).resolved()
            for combo in itertools.product(*(sweep[k] for k in keys))]


def _fmt(m: dict) -> str:
    return f"{m['img_per_s']:,.1f} img/s ({m['seconds']:.0f} s)"


def run_sweep(cfg: BenchConfig, sweep: dict[str, list] | None = None, log=None) -> dict:
    """Every configuration of the sweep: model-only once per model setting, loader-only and end to end per row,
    within cfg.max_seconds in all. `log(line)` reports progress as it goes."""
    log = log or (lambda line: None)
    sweep = sweep or {}
    configs = grid(cfg, sweep)
    manifest = load(configs[0].data, cache_dir=configs[0].cache_dir, cache_limit=configs[0].cache_limit)
    models = {c.model_key() for c in configs}
    budget = Budget(configs[0].max_seconds, len(models) * (2 if configs[0].augment else 1) + 2 * len(configs))
    log(f"bench: {len(configs)} configuration(s), {budget.describe()}")
    model_rates, aug_rates, rows = {}, {}, []
    for i, c in enumerate(configs, 1):
        name = f"[{i}/{len(configs)}] {c.backend} workers={c.workers if c.workers is not None else 'auto'} " \
               f"batch {c.batch_size} {c.image_size}px"
        if c.model_key() not in model_rates:
            log(f"{name}: model only ({c.model}, {c.amp}, synthetic data on {c.device}) ...")
            model_rates[c.model_key()] = model_only(c, manifest, budget.share())
            log(f"  model only: {_fmt(model_rates[c.model_key()])}")
            if c.augment:
                aug_rates[c.model_key()] = augment_only(c, manifest, budget.share())
                log(f"  augmentation ({c.augment}) adds {aug_rates[c.model_key()]['ms_per_batch']:.1f} ms per batch")
        try:
            log(f"{name}: loader only, then end to end ...")
            lo, e2e, loader = loader_and_e2e(c, manifest, budget.share())
        except ImportError as e:  # e.g. DALI not installed: the row says so instead of failing the sweep
            rows.append({"config": asdict(c), "skipped": str(e)})
            log(f"  skipped: {str(e)[:100]}")
            budget.skip(2)
            continue
        log(f"  loader only: {_fmt(lo)}; end to end: {_fmt(e2e)}")
        mo = model_rates[c.model_key()]
        row = {"config": asdict(c), "loader_workers": getattr(loader, "num_workers", None),
               "decoder": loader.describe().get("decoder"), "loader_only": lo,
               "model_only": mo, "end_to_end": e2e,
               **verdict(lo["img_per_s"], mo["img_per_s"], e2e["img_per_s"], e2e["data_wait"])}
        if c.model_key() in aug_rates:  # the share of an end-to-end step the augmentation takes
            row["augment_only"] = aug_rates[c.model_key()]
            row["augment_share"] = e2e["img_per_s"] / max(aug_rates[c.model_key()]["img_per_s"], 1e-9)
        row["advice"] = advice(row, manifest)
        rows.append(row)
        del loader
    done = [r for r in rows if "skipped" not in r]
    best = max(done, key=lambda r: r["end_to_end"]["img_per_s"], default=None)
    return {"rows": rows, "best": best["config"] if best else None, "machine": machine_info(),
            "sweep": {k: [str(x) for x in v] for k, v in sweep.items()}, "seconds": budget.elapsed(),
            "headroom_definition": "loader_only / model_only"}


def run_one(cfg: BenchConfig) -> dict:
    """The three measurements and the verdict for one configuration."""
    return run_sweep(cfg)["rows"][0]


def machine_info() -> dict:
    import platform

    import torchvision

    info = {"cpus": os.cpu_count(), "usable_cores": usable_cores(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


__all__ = ["BenchConfig", "run_one", "run_sweep", "split_sweep", "verdict"]

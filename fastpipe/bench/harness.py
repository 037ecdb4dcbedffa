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
from fastpipe.bench.verdict import BUSY_SHARE, advice, contradiction, too_short, verdict
from fastpipe.loaders import LoaderConfig, make_loader_from
from fastpipe.manifest import load
from fastpipe.train.config import TrainConfig
from fastpipe.train.loop import Dist, Trainer, make_optimizer
from fastpipe.train.models import build_model
from fastpipe.util import usable_cores


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
                      device=cfg.device, num_workers=cfg.workers, pin_memory=cfg.pin_memory, normalize=cfg.normalize,
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


def model_only(cfg: BenchConfig, step, batch: tuple, seconds: float | None) -> dict:
    """The training step on one batch held on the device: what the model consumes with no loader at all."""
    x, y = batch

    def timed():
        step(x, y)
        return len(y)

    return _measure(cfg, timed, seconds)


def loader_only(cfg: BenchConfig, batches, seconds: float | None) -> dict:
    def timed():
        x, _ = next(batches)
        return len(x)

    return _measure(cfg, timed, seconds)


def end_to_end(cfg: BenchConfig, batches, step, seconds: float | None) -> dict:
    """The training step fed by the loader, and the share of the time spent waiting for its batches."""
    waited = [0.0]

    def timed():
        t = time.perf_counter()
        x, y = next(batches)
        waited[0] += time.perf_counter() - t
        step(x, y)
        return len(y)

    start = time.perf_counter()
    e2e = _measure(cfg, timed, seconds)
    e2e["data_wait"] = waited[0] / max(time.perf_counter() - start, 1e-9)
    return e2e


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


def judge(cfg: BenchConfig, batches, step, synthetic: tuple, budget: Budget, model: dict | None = None,
          log=lambda line: None) -> dict:
    """The three measurements of one configuration and their verdict. Figures too short to mean anything give no
    verdict; figures that contradict each other are measured once more, and if they still do, the row is
    'disturbed', with the CPU share other processes took, instead of a verdict. `model`: a model-only
    measurement of the same model setting to reuse."""
    mo = model or model_only(cfg, step, synthetic, budget.share())
    if model is None:
        log(f"  model only: {_fmt(mo)}")
    lo = loader_only(cfg, batches, budget.share())
    e2e = end_to_end(cfg, batches, step, budget.share())
    log(f"  loader only: {_fmt(lo)}; end to end: {_fmt(e2e)}")
    short = too_short({"loader only": lo, "model only": mo, "end to end": e2e})
    problem = None if short else contradiction(lo, mo, e2e)
    if problem:
        log(f"  {problem}: impossible, measuring the three again")
        budget.extra(3)
        mo = model_only(cfg, step, synthetic, budget.share())
        lo = loader_only(cfg, batches, budget.share())
        e2e = end_to_end(cfg, batches, step, budget.share())
        log(f"  again: model only {_fmt(mo)}; loader only {_fmt(lo)}; end to end {_fmt(e2e)}")
        short = too_short({"loader only": lo, "model only": mo, "end to end": e2e})
        problem = None if short else contradiction(lo, mo, e2e)
    row = {"loader_only": lo, "model_only": mo, "end_to_end": e2e, "headroom": lo["img_per_s"] / mo["img_per_s"],
           "others_cpu_pct": max(m.get("others_cpu_pct") or 0 for m in (lo, mo, e2e))}
    if short:
        row.update(verdict="not measured", verdict_text=f"not measured: {short}")
    elif problem:
        row.update(verdict="disturbed", verdict_text=f"disturbed: {problem}, measured twice; {_others(row)}")
    else:
        row.update(verdict(lo["img_per_s"], mo["img_per_s"], e2e["img_per_s"], e2e["data_wait"]))
    row["caveats"] = [f"other processes took {row['others_cpu_pct']:.0f}% of the CPU while this was measured: the "
                      f"figures may be low"] if row["others_cpu_pct"] >= 100 * BUSY_SHARE and not problem else []
    return row


def _others(row: dict) -> str:
    share = row["others_cpu_pct"]
    if share >= 100 * BUSY_SHARE:
        return f"other processes took {share:.0f}% of the CPU meanwhile: rerun when the machine is quiet"
    return (f"other processes took only {share:.0f}% of the CPU: the device or this machine's clock varies; "
            f"rerun with more --steps")


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
    configs = grid(cfg, sweep or {})  # every setting checked (BenchConfig) before anything is measured
    manifest = load(configs[0].data, cache_dir=configs[0].cache_dir, cache_limit=configs[0].cache_limit)
    models = {c.model_key() for c in configs}
    budget = Budget(configs[0].max_seconds, len(models) * (2 if configs[0].augment else 1) + 2 * len(configs))
    log(f"bench: {len(configs)} configuration(s), {budget.describe()}")
    model_rates, aug_rates, rows = {}, {}, []
    for i, c in enumerate(configs, 1):
        name = f"[{i}/{len(configs)}] {c.backend} workers={c.workers if c.workers is not None else 'auto'} " \
               f"batch {c.batch_size} {c.image_size}px"
        if c.augment and c.model_key() not in aug_rates:
            aug_rates[c.model_key()] = augment_only(c, manifest, budget.share())
            log(f"  augmentation ({c.augment}) adds {aug_rates[c.model_key()]['ms_per_batch']:.1f} ms per batch")
        try:
            log(f"{name}: model only ({c.model}, {c.amp}, synthetic data on {c.device}), loader only, end to end ...")
            loader = _loader(c, manifest, c.backend)
        except ImportError as e:  # e.g. DALI not installed: the row says so instead of failing the sweep
            rows.append({"config": asdict(c), "skipped": str(e)})
            log(f"  skipped: {str(e)[:100]}")
            budget.skip(2)
            continue
        rows.append(_row(c, manifest, loader, budget, model_rates, aug_rates, log))
        del loader
    good = [r for r in rows if r.get("verdict") not in (None, "not measured", "disturbed")]
    best = max(good, key=lambda r: r["end_to_end"]["img_per_s"], default=None)
    return {"rows": rows, "best": best["config"] if best else None, "machine": machine_info(),
            "sweep": {k: [str(x) for x in v] for k, v in (sweep or {}).items()}, "seconds": budget.elapsed(),
            "headroom_definition": "loader_only / model_only"}


def _row(c: BenchConfig, manifest, loader, budget: Budget, model_rates: dict, aug_rates: dict, log) -> dict:
    trainer = _trainer(c, manifest.num_classes)
    trainer.model.train()
    streak = torch.zeros((), dtype=torch.int64, device=trainer.device)
    synthetic = next(iter(_loader(c, manifest, "synthetic")))
    row = {"config": asdict(c), "loader_workers": getattr(loader, "num_workers", None),
           "decoder": loader.describe().get("decoder"),
           **judge(c, _batches(loader), lambda x, y: trainer.step(x, y, 0, 1, streak), synthetic, budget,
                   model_rates.get(c.model_key()), log)}
    if row["verdict"] not in ("not measured", "disturbed"):
        model_rates.setdefault(c.model_key(), row["model_only"])  # shared by the rows with the same model
    if c.model_key() in aug_rates:  # the share of an end-to-end step the augmentation takes
        row["augment_only"] = aug_rates[c.model_key()]
        row["augment_share"] = row["end_to_end"]["img_per_s"] / max(aug_rates[c.model_key()]["img_per_s"], 1e-9)
    row["advice"] = advice(row, manifest)
    log(f"  {row['verdict_text']}")
    return row


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


__all__ = ["BenchConfig", "judge", "run_one", "run_sweep", "split_sweep", "verdict"]

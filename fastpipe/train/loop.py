"""`fastpipe train`: the AMP training loop. Short and explicit on purpose; every host sync is marked.

One process per device; under `torchrun` it becomes DistributedDataParallel with the loaders' rank split.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from fastpipe import __version__
from fastpipe.loaders import LoaderConfig, make_loader_from
from fastpipe.manifest import load
from fastpipe.train.config import TrainConfig, image_size_for_epoch
from fastpipe.train.models import build_model
from fastpipe.train.runs import Run, default_run_dir

OOM_ADVICE = ("CUDA ran out of memory. Lower --batch-size (and keep the effective batch with --accum-steps), "
              "use --amp fp16 or bf16, --checkpoint-activations, or a smaller --image-size; "
              "`fastpipe memory --model {model} --image-size {size}` shows what fits; --auto-batch finds it.")


class TrainingStopped(RuntimeError):
    """The run cannot continue (non-finite losses, out of memory); the message says what to change."""


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str | None) -> tuple[Dist, torch.device]:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: then NCCL on GPUs, gloo on CPU. Else a single process."""
    if "RANK" not in os.environ or dist.is_initialized():
        d = Dist(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else Dist()
        return d, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local), torch.device(f"cuda:{local}" if use_cuda else "cpu")


def resolve(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Fill the defaults that depend on the device and the batch."""
    cuda = device.type == "cuda"
    eff = cfg.batch_size * cfg.accum_steps
    # SGD: the linear scaling rule (0.1 per 256 images, Goyal et al.); AdamW: its usual 1e-3, which small
    # data sets train well with (Adam's step size is less tied to the batch).
    lr = cfg.lr if cfg.lr is not None else (0.1 * eff / 256 if cfg.optimizer == "sgd" else 1e-3)
    return replace(cfg, device=str(device), lr=lr, amp=cfg.amp or ("fp16" if cuda else "off"),
                   channels_last=cuda if cfg.channels_last is None else cfg.channels_last,
                   out=cfg.out or str(default_run_dir(cfg.model)))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on norms and biases: the usual recipe (timm, torchvision references).
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def make_schedule(opt, cfg: TrainConfig, steps_per_epoch: int):
    """Linear warm-up, then cosine to zero, stepped per optimizer step."""
    total = max(1, cfg.epochs * steps_per_epoch)
    warm = min(int(cfg.warmup_epochs * steps_per_epoch), total - 1)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def amp_dtype(mode: str):
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode)


@dataclass
class Trainer:
    cfg: TrainConfig
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: object
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    device: torch.device
    dist: Dist

    def autocast(self):
        return torch.autocast(self.device.type, dtype=amp_dtype(self.cfg.amp), enabled=self.cfg.amp != "off")

    def step(self, x, y, i: int, accum: int, streak: torch.Tensor) -> torch.Tensor:
        """One micro-batch: forward, backward, and every `accum` micro-batches the optimizer step."""
        last_micro = (i + 1) % accum == 0
        no_sync = getattr(self.model, "no_sync", None)
        with (no_sync() if no_sync and not last_micro else contextlib.nullcontext()):
            with self.autocast():
                loss = self.criterion(self.model(x), y)
            self.scaler.scale(loss / accum).backward()  # BatchNorm still sees only the micro-batch
        finite = torch.isfinite(loss.detach())
        streak.copy_(torch.where(finite, 0, streak + 1))  # on the device: no sync here
        if last_micro:
            self.scaler.step(self.opt)  # fp16: skipped when the scaled gradients hold inf/NaN
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
        return torch.where(finite, loss.detach(), 0.0)

    def train_epoch(self, loader, epoch: int) -> dict:
        self.model.train()
        accum = self.cfg.accum_steps
        steps = (len(loader) // accum) * accum  # micro-batches past the last full accumulation are left out
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        loss_sum = torch.zeros((), device=self.device)
        streak = torch.zeros((), dtype=torch.int64, device=self.device)
        n, wait, start = 0, 0.0, time.perf_counter()
        bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{self.cfg.epochs}", unit="batch",
                   disable=not self.dist.main, leave=False)
        it = iter(loader)
        for i in range(steps):
            t = time.perf_counter()
            x, y = next(it)
            wait += time.perf_counter() - t
            loss_sum += self.step(x, y, i, accum, streak)
            n += len(y)
            bar.update(1)
            if (i + 1) % self.cfg.log_every == 0 or i + 1 == steps:
                self._check(streak, epoch, i)  # host sync: reads the loss and the non-finite streak
                elapsed = time.perf_counter() - start
                bar.set_postfix(img_s=f"{n * self.dist.world / elapsed:.0f}", wait=f"{100 * wait / elapsed:.0f}%",
                                loss=f"{loss_sum.item() / (i + 1):.3f}")
        it.close()  # an epoch cut short by --accum-steps: release the loader's iterator now
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock is read after the device has finished
        seconds = time.perf_counter() - start
        stats = self._reduce(torch.tensor([loss_sum.item(), steps, n, wait, seconds], dtype=torch.float64))
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        return {"train_loss": stats[0] / max(stats[1], 1), "img_per_s": stats[2] / (seconds or 1e-9),
                "data_wait": wait / (seconds or 1e-9), "seconds": seconds, "peak_mem_mb": peak,
                "lr": self.opt.param_groups[0]["lr"], "train_samples": int(stats[2])}

    def _check(self, streak: torch.Tensor, epoch: int, i: int) -> None:
        bad = int(streak.item())
        if bad >= self.cfg.max_nonfinite:
            raise TrainingStopped(
                f"the loss was not finite for {bad} steps in a row (epoch {epoch + 1}, step {i + 1}). "
                f"Lower --lr (now {self.cfg.lr:g}), use --amp bf16 or fp16 (its scaler skips bad steps) "
                f"instead of {self.cfg.amp}, and check the data with `fastpipe inspect --verify`.")

    def _reduce(self, t: torch.Tensor) -> list[float]:
        """Sum across ranks (the loss and counts); wait and seconds are averaged."""
        if self.dist.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
            t[3:] /= self.dist.world
        return t.cpu().tolist()

    @torch.no_grad()
    def evaluate(self, loader, k: int) -> dict:
        self.model.eval()
        confusion = torch.zeros(k * k, dtype=torch.int64, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in loader:
            if len(y) == 0:
                continue
            with self.autocast():
                out = self.model(x)
            loss_sum += nn.functional.cross_entropy(out.float(), y, reduction="sum").double()
            confusion += torch.bincount(y * k + out.argmax(1), minlength=k * k)
        if self.dist.world > 1:
            dist.all_reduce(confusion)
            dist.all_reduce(loss_sum)
        cm = confusion.view(k, k).cpu()  # host sync, once per evaluation
        total = int(cm.sum())
        per_class = (cm.diag().double() / cm.sum(1).clamp(min=1).double()).tolist()
        return {"val_acc": float(cm.diag().sum()) / max(total, 1), "val_loss": float(loss_sum) / max(total, 1),
                "per_class_acc": per_class, "confusion": cm.tolist(), "val_samples": total}

    def state(self, epoch: int) -> dict:
        model = self.model.module if hasattr(self.model, "module") else self.model
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
        return {"epoch": epoch, "model": model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def restore(self, state: dict) -> int:
        model = self.model.module if hasattr(self.model, "module") else self.model
        getattr(model, "_orig_mod", model).load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        return state["epoch"] + 1


def versions() -> dict:
    import PIL
    import torchvision

    return {"fastpipe": __version__, "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda, "pillow": PIL.__version__, "python": platform.python_version()}


def _loader_cfg(cfg: TrainConfig, split: str, size: int, batch: int) -> LoaderConfig:
    return LoaderConfig(backend=cfg.backend, split=split, batch_size=batch, image_size=size, device=cfg.device,
                        num_workers=cfg.workers, seed=cfg.seed, balance=cfg.balance and split == "train")


def _build(cfg: TrainConfig, manifest, device: torch.device, d: Dist):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, manifest.num_classes, cfg.image_size, cfg.pretrained,
                        cfg.checkpoint_activations).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if d.world > 1 and cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.compile:
        model = torch.compile(model)
    if d.world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if device.type == "cuda" else None)
    return model


def _auto_batch(cfg: TrainConfig, manifest, device: torch.device) -> TrainConfig:
    if device.type != "cuda":
        print("--auto-batch: only meaningful on a CUDA device; keeping --batch-size", cfg.batch_size)
        return cfg
    from fastpipe.train.memory import MemoryConfig, find_max_batch

    found = find_max_batch(MemoryConfig(model=cfg.model, image_size=cfg.image_size, optimizer=cfg.optimizer,
                                        amp=cfg.amp, num_classes=manifest.num_classes, device=str(device),
                                        checkpoint_activations=cfg.checkpoint_activations,
                                        channels_last=bool(cfg.channels_last)))
    print(f"--auto-batch: the largest batch that fits is {found}")
    return replace(cfg, batch_size=found)


def train(cfg: TrainConfig) -> Path:
    """Train cfg.model on cfg.data; returns the run folder."""
    cfg.validate()
    d, device = setup_distributed(cfg.device)
    cfg = resolve(cfg, device)
    manifest = load(cfg.data)
    if cfg.auto_batch:
        cfg = _auto_batch(cfg, manifest, device)
    run = Run(Path(cfg.out))
    model = _build(cfg, manifest, device, d)
    val_size = image_size_for_epoch(cfg, cfg.epochs - 1)
    val_loader = make_loader_from(manifest, _loader_cfg(cfg, "val", val_size, cfg.batch_size))
    loaders: dict[int, object] = {}

    def train_loader(size: int):
        if size not in loaders:
            loaders[size] = make_loader_from(manifest, _loader_cfg(cfg, "train", size, cfg.batch_size))
        return loaders[size]

    steps = len(train_loader(image_size_for_epoch(cfg, 0))) // cfg.accum_steps
    opt = make_optimizer(model, cfg)
    weights = torch.tensor(manifest.class_weights(), device=device) if cfg.class_weighted_loss else None
    trainer = Trainer(cfg, model, opt, make_schedule(opt, cfg, steps),
                      torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16"),
                      nn.CrossEntropyLoss(weight=weights, label_smoothing=cfg.label_smoothing), device, d)
    start = 0
    if cfg.resume and (state := run.load()) is not None:
        start = trainer.restore(state)
    if d.main:
        run.start({"train": asdict(cfg), "versions": versions(), "device": _device_info(device),
                   "world_size": d.world, "data": {"root": str(manifest.root), "classes": list(manifest.classes),
                                                   "mean": manifest.mean, "std": manifest.std},
                   "loader": train_loader(image_size_for_epoch(cfg, 0)).describe()}, resume=cfg.resume)
        run.truncate_metrics(start)
    return _epochs(trainer, run, manifest, train_loader, val_loader, start, d)


def _epochs(trainer: Trainer, run: Run, manifest, train_loader, val_loader, start: int, d: Dist) -> Path:
    cfg, began, status = trainer.cfg, time.time(), "finished"
    last = min(cfg.epochs, start + cfg.stop_after) if cfg.stop_after else cfg.epochs
    try:
        for epoch in range(start, last):
            size = image_size_for_epoch(cfg, epoch)
            loader = train_loader(size)
            loader.set_epoch(epoch)
            m = {"epoch": epoch, "image_size": size, **trainer.train_epoch(loader, epoch),
                 **trainer.evaluate(val_loader, manifest.num_classes)}
            if d.main:
                run.log(m)
                run.save(trainer.state(epoch))
                print(f"epoch {epoch + 1}/{cfg.epochs}  size {size}  loss {m['train_loss']:.3f}  "
                      f"val acc {m['val_acc']:.3f}  {m['img_per_s']:.0f} img/s  "
                      f"data wait {100 * m['data_wait']:.0f}%"
                      + (f"  peak {m['peak_mem_mb']:.0f} MB" if m["peak_mem_mb"] else ""))
        status = "finished" if last == cfg.epochs else f"stopped after epoch {last} (--stop-after); --resume continues"
    except torch.OutOfMemoryError as e:
        status = "out of memory"
        raise TrainingStopped(OOM_ADVICE.format(model=cfg.model, size=cfg.image_size) + f"\n({e})") from e
    except TrainingStopped as e:
        status = f"stopped: {e}"
        raise
    finally:
        if d.main:
            run.finish(_summary(run, cfg, status, time.time() - began), manifest.classes)
    return run.path


def _summary(run: Run, cfg: TrainConfig, status: str, seconds: float) -> dict:
    ms = run.metrics()
    best = max((m["val_acc"] for m in ms), default=None)
    return {"status": status, "epochs_done": len(ms), "best_val_acc": best,
            "final_val_acc": ms[-1]["val_acc"] if ms else None,
            "img_per_s": sum(m["img_per_s"] for m in ms) / len(ms) if ms else None,
            "data_wait_pct": 100 * sum(m["data_wait"] for m in ms) / len(ms) if ms else None,
            "peak_mem_mb": max((m["peak_mem_mb"] or 0 for m in ms), default=None) or None,
            "minutes": seconds / 60, "model": cfg.model, "backend": cfg.backend, "run": str(run.path)}


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1)}
    return {"type": "cpu", "cores": os.cpu_count(), "name": platform.processor() or platform.machine()}

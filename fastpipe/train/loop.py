"""The AMP training step and epoch. Short and explicit on purpose; every host sync is marked.

session.py builds the run around it (model, loaders, run folder, resume); this file is the loop itself.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from fastpipe.errors import FastpipeError
from fastpipe.train.config import TrainConfig
from fastpipe.train.stop import StopRequest


class TrainingStopped(FastpipeError, RuntimeError):
    """The run cannot continue (non-finite losses, out of memory); the message says what to change."""


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


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
    stop: StopRequest = field(default_factory=StopRequest)  # SIGINT/SIGTERM: stop between steps

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
            self._stop_point(i)
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

    def _stop_point(self, i: int) -> None:
        """Stop here if a signal asked for it. With several ranks, all must agree or the others would hang in the
        next collective: the flag is all-reduced every log_every steps (a sync the progress update makes anyway)."""
        if self.dist.world == 1:
            self.stop.check()
        elif (i + 1) % self.cfg.log_every == 0:
            flag = torch.tensor([1.0 if self.stop.signal_name else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                self.stop.signal_name = self.stop.signal_name or "SIGTERM"
                self.stop.check()

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
        for i, (x, y) in enumerate(loader):
            self._stop_point(i)
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

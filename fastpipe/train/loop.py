"""The AMP training step and epoch. Short and explicit on purpose; every host sync is marked.

session.py builds the run around it (model, loaders, run folder, resume); this file is the loop itself.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from fastpipe.errors import FastpipeError
from fastpipe.loaders.stats import WORKER_STAGES, leading_stage, wait_verdict
from fastpipe.train.config import TrainConfig
from fastpipe.train.models import plain_names
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
class EpochProgress:
    """How far an epoch is, summed over the ranks: saved in mid-epoch checkpoints so that a resumed epoch goes on
    from the next step and reports the figures of the whole epoch."""

    step: int = 0  # micro-batches done (this rank's count; equal on every rank)
    batches: int = 0  # micro-batches done, all ranks
    images: int = 0  # all ranks
    loss_sum: float = 0.0  # all ranks
    wait: float = 0.0  # seconds, mean over ranks
    seconds: float = 0.0


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
    stop: StopRequest = field(default_factory=StopRequest)  # SIGINT/SIGTERM: stop at the next optimizer step
    global_step: int = 0  # optimizer steps since the start of the run
    checkpoint: object = None  # checkpoint(epoch, progress, loader): the session's mid-epoch save
    log_step: object = None  # log_step(record): the session's metrics.jsonl
    normalization: str = ""  # the inputs' mean and std (options.normalize_text), kept with the weights
    card: dict | None = None  # how to use the weights on new photos (modelcard.py), kept with them

    def autocast(self):
        return torch.autocast(self.device.type, dtype=amp_dtype(self.cfg.amp), enabled=self.cfg.amp != "off")

    def step(self, x, y, i: int, accum: int, streak: torch.Tensor) -> torch.Tensor:
        """One micro-batch: forward, backward, and every `accum` micro-batches the optimizer step. Returns the loss,
        0 where it is not finite (`streak` counts those in a row; `finite_losses` below counts the others)."""
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
            with warnings.catch_warnings():  # the scaler skipping the first step (fp16) is normal, not the old order
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before")
                self.sched.step()
        return torch.where(finite, loss.detach(), 0.0)

    def train_epoch(self, loader, epoch: int, resumed: EpochProgress | None = None) -> dict:
        """The epoch's micro-batches from where `resumed` left it (or the start); returns the epoch's figures."""
        self.model.train()
        accum = self.cfg.accum_steps
        todo = (loader.batches_left // accum) * accum  # micro-batches past the last full accumulation: left out
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        base = resumed if resumed is not None and self.dist.main else EpochProgress()  # sums restart on rank 0
        loss_sum = torch.full((), base.loss_sum, device=self.device)
        streak = torch.zeros((), dtype=torch.int64, device=self.device)
        finite = torch.zeros((), dtype=torch.int64, device=self.device)  # this call's micro-batches with a finite loss
        first = resumed.step if resumed is not None else 0
        n, wait, start = base.images, base.wait, time.perf_counter() - base.seconds
        bar = tqdm(total=first + todo, initial=first, desc=f"epoch {epoch + 1}/{self.cfg.epochs}", unit="batch",
                   disable=not self.dist.main, leave=False)
        it = iter(loader)
        for j in range(todo):
            i = first + j
            t = time.perf_counter()
            try:
                x, y = next(it)
            except RuntimeError as e:
                if not str(e).startswith("DataLoader worker"):
                    raise
                at = EpochProgress(i, base.batches + j, n, loss_sum.item(), wait, time.perf_counter() - start)
                raise self._worker_lost(e, loader, epoch, at) from None
            wait += time.perf_counter() - t
            loss_sum += self.step(x, y, i, accum, streak)
            finite += streak == 0
            n += len(y)
            bar.update(1)
            if (i + 1) % accum == 0:
                self._after_step(loader, epoch, EpochProgress(i + 1, base.batches + j + 1, n, 0.0, wait,
                                                              time.perf_counter() - start), loss_sum, streak, bar)
        it.close()  # an epoch cut short by --accum-steps: release the loader's iterator now
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock is read after the device has finished
        seconds = time.perf_counter() - start
        bad = todo - int(finite)  # host sync, once per epoch
        loss, batches, images, bad, done, streaks, _, _ = self._reduce(torch.tensor(
            [loss_sum.item(), base.batches + todo - bad, n, bad, todo, int(streak >= self.cfg.max_nonfinite), wait,
             seconds], dtype=torch.float64))
        # Checked on every rank alike (one rank stopping alone would leave the others waiting in a collective), and
        # here too, since an epoch may be shorter than --log-every.
        if done and bad == done:  # not one finite loss in this epoch: nothing was learnt
            raise TrainingStopped(self._nonfinite_advice(f"in any of the epoch's {int(done)} steps", epoch))
        if streaks:
            raise TrainingStopped(self._nonfinite_advice(f"for {self.cfg.max_nonfinite}+ steps in a row", epoch))
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        stages = getattr(getattr(loader, "stats", None), "per_image", dict)()  # this rank's loader, by stage
        return {"train_loss": loss / max(batches, 1), "img_per_s": images / (seconds or 1e-9),
                "data_wait": wait / (seconds or 1e-9), "verdict": wait_verdict(wait / (seconds or 1e-9)),
                "loader_ms_per_image": {k: round(1000 * v, 4) for k, v in stages.items()},
                "loader_leading_stage": leading_stage(stages, getattr(loader, "num_workers", 0) or 0)
                if any(k in WORKER_STAGES for k in stages) else None,
                "seconds": seconds, "peak_mem_mb": peak,
                "lr": self.opt.param_groups[0]["lr"], "train_samples": int(images), "nonfinite_steps": int(bad)}

    def _after_step(self, loader, epoch: int, p: EpochProgress, loss_sum, streak, bar) -> None:
        """At an optimizer-step boundary (a consistent state): progress, metrics, periodic checkpoint, stop."""
        self.global_step += 1
        cfg = self.cfg
        if self.global_step % cfg.log_every == 0:
            self._check(streak, epoch, p.step)  # host sync: reads the loss and the non-finite streak
            loss = loss_sum.item() / max(p.step, 1)
            bar.set_postfix(img_s=f"{p.images * self.dist.world / max(p.seconds, 1e-9):.0f}",
                            wait=f"{100 * p.wait / max(p.seconds, 1e-9):.0f}%", loss=f"{loss:.3f}")
            if self.log_step and self.dist.main:
                self.log_step({"kind": "step", "step": self.global_step, "epoch": epoch, "loss": loss,
                               "lr": self.opt.param_groups[0]["lr"]})
        stopping = self._stop_agreed()
        if self.checkpoint and (stopping or (cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0)):
            p.loss_sum = loss_sum.item()  # host sync, only when saving
            self.checkpoint(epoch, self._summed(p), loader)
        if stopping:
            self.stop.check()

    def _worker_lost(self, e: RuntimeError, loader, epoch: int, at: EpochProgress) -> TrainingStopped:
        """A loader worker process died (the kernel's out-of-memory killer, most often): what happened and what to
        change, and a checkpoint when the state allows one (at an optimizer-step boundary, one process)."""
        saved = ""
        if self.checkpoint and self.dist.world == 1 and at.step % self.cfg.accum_steps == 0:
            self.checkpoint(epoch, at, loader)
            saved = f" The run was saved at step {self.global_step}: --resume continues from there."
        workers = getattr(loader, "num_workers", "?")
        return TrainingStopped(
            f"a loader worker process died ({str(e).split(':', 1)[-1].strip().rstrip('. ')}): most likely the system "
            f"ran out of memory. Use fewer --workers (now {workers}), a smaller --batch-size, or close other "
            f"programs.{saved}")

    def _summed(self, p: EpochProgress) -> EpochProgress:
        """The progress of every rank together (what a checkpoint keeps)."""
        if self.dist.world == 1:
            return p
        t = torch.tensor([p.batches, p.images, p.loss_sum, p.wait, p.seconds], dtype=torch.float64,
                         device=self.device)
        dist.all_reduce(t)
        b, n, loss, wait, seconds = t.tolist()
        return EpochProgress(p.step, int(b), int(n), loss, wait / self.dist.world, seconds / self.dist.world)

    def _check(self, streak: torch.Tensor, epoch: int, i: int) -> None:
        bad = int(streak.item())
        if bad >= self.cfg.max_nonfinite:
            raise TrainingStopped(self._nonfinite_advice(f"for {bad} steps in a row", epoch, i))

    def _nonfinite_advice(self, how: str, epoch: int, i: int | None = None) -> str:
        where = f"epoch {epoch + 1}" + (f", step {i + 1}" if i is not None else "")
        return (f"the loss was not finite {how} ({where}). Lower --lr (now {self.cfg.lr:g}), use --amp bf16 or "
                f"fp16 (its scaler skips bad steps) instead of {self.cfg.amp}, check --pretrained weights and "
                f"--augment settings, and check the data with `fastpipe inspect --verify`.")

    def _stop_agreed(self) -> bool:
        """Whether a signal asked to stop. With several ranks all must agree, or the others would hang in the next
        collective: the flag is all-reduced every log_every optimizer steps (beside the progress sync)."""
        if self.dist.world == 1:
            return self.stop.signal_name is not None
        if self.global_step % self.cfg.log_every:
            return False
        flag = torch.tensor([1.0 if self.stop.signal_name else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.stop.signal_name = self.stop.signal_name or "SIGTERM"
        return bool(flag.item())

    def _reduce(self, t: torch.Tensor) -> list[float]:
        """Sum across ranks (the loss and counts); the last two (wait and seconds) are averaged."""
        if self.dist.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
            t[-2:] /= self.dist.world
        return t.cpu().tolist()

    def stop_now(self) -> None:
        """At an epoch's end (every rank is there): stop if a signal asked for it."""
        if self.dist.world > 1:
            flag = torch.tensor([1.0 if self.stop.signal_name else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                self.stop.signal_name = self.stop.signal_name or "SIGTERM"
        self.stop.check()

    def evaluate(self, loader, k: int, errors: int = 32) -> dict:
        """The validation figures (evaluation.py)."""
        from fastpipe.train.evaluation import evaluate

        return evaluate(self, loader, k, errors)

    def bare_model(self) -> nn.Module:
        model = self.model.module if hasattr(self.model, "module") else self.model  # DDP's wrapper
        return getattr(model, "_orig_mod", model)  # torch.compile's wrapper

    def state(self, epoch: int) -> dict:
        return {"epoch": epoch, "model": self.bare_model().state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                "global_step": self.global_step, "step_samples": self._step_samples(),
                "normalize": self.normalization,  # what --pretrained of these weights normalises with
                "inference": self.card,
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def _step_samples(self) -> int:
        return self.dist.world * self.cfg.batch_size * self.cfg.accum_steps

    def restore(self, state: dict) -> None:
        model = self.bare_model()
        model.load_state_dict(plain_names(state["model"], model))
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.global_step = int(state.get("global_step", 0))
        before = int(state.get("step_samples") or self._step_samples())
        if before != self._step_samples():
            # Resumed with other ranks, batch or accumulation: the schedule goes on from the samples seen so far.
            self.sched.last_epoch = round(self.global_step * before / self._step_samples())
            for group, lr in zip(self.opt.param_groups, self.sched.get_lr()):
                group["lr"] = lr
        torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])

"""`fastpipe train`: a training run around the loop (loop.py): device and ranks, model, loaders, the run folder,
resuming, and a summary that says how the run ended (finished, stopped, interrupted, failed) whatever happens.

One process per device; under `torchrun` it becomes DistributedDataParallel with the loaders' rank split.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn

from fastpipe import __version__
from fastpipe.dataset.loading import load
from fastpipe.errors import ConfigError
from fastpipe.loaders import LoaderConfig, make_loader_from
from fastpipe.loaders.stats import OthersClock
from fastpipe.options import amp_for, check_number, normalization, normalize_text
from fastpipe.train.config import RESUMABLE_CHANGES, TrainConfig, image_size_for_epoch, resumed_config
from fastpipe.train.distributed import distributed
from fastpipe.train.errors import write_errors
from fastpipe.train.loop import Dist, EpochProgress, Trainer, TrainingStopped, make_optimizer, make_schedule
from fastpipe.train.models import build_model, pretrained_normalization, pretrained_origin, weights_said
from fastpipe.train.runs import Run, RunError, default_run_dir
from fastpipe.train.speed import disturbed, run_speed

OOM_ADVICE = ("CUDA ran out of memory. Lower --batch-size (and keep the effective batch with --accum-steps), "
              "use --amp fp16 or bf16, --checkpoint-activations, or a smaller --image-size; "
              "`fastpipe memory --model {model} --image-size {size}` shows what fits; --auto-batch finds it.")


def resolve(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Fill the defaults that depend on the device and the batch."""
    cuda = device.type == "cuda"
    eff = cfg.batch_size * cfg.accum_steps
    # SGD: the linear scaling rule (0.1 per 256 images, Goyal et al.); AdamW: its usual 1e-3, which small
    # data sets train well with (Adam's step size is less tied to the batch).
    lr = cfg.lr if cfg.lr is not None else (0.1 * eff / 256 if cfg.optimizer == "sgd" else 1e-3)
    # Fine-tuning needs the inputs the weights were trained on; from scratch, the data set's own statistics fit
    normalize = cfg.normalize or ("pretrained" if cfg.pretrained else "dataset")
    if normalize == "pretrained":
        if not cfg.pretrained:
            raise ConfigError("--normalize pretrained: there are no pretrained weights; give --pretrained FILE or "
                              "--pretrained zoo, or --normalize dataset")
        normalize = pretrained_normalization(cfg.model, cfg.pretrained)
    return replace(cfg, device=str(device), lr=lr, amp=amp_for(cfg.amp, cuda), normalize=normalize,
                   channels_last=cuda if cfg.channels_last is None else cfg.channels_last,
                   out=cfg.out or str(default_run_dir(cfg.model)))


def versions() -> dict:
    import PIL
    import torchvision

    return {"fastpipe": __version__, "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda, "pillow": PIL.__version__, "python": platform.python_version()}


def _loader_cfg(cfg: TrainConfig, split: str, size: int, batch: int) -> LoaderConfig:
    train = split == "train"
    return LoaderConfig(backend=cfg.backend, split=split, batch_size=batch, image_size=size, device=cfg.device,
                        num_workers=cfg.workers, threads=cfg.threads, seed=cfg.seed, balance=cfg.balance and train,
                        normalize=cfg.normalize,
                        augment=cfg.augment if train else None, label_smoothing=cfg.label_smoothing)


def _criterion(cfg: TrainConfig, manifest, device: torch.device) -> nn.Module:
    """Multi-label data: BCEWithLogitsLoss with the data set's pos_weight (negatives / positives per class).
    Single-label: cross-entropy, which also takes the soft targets of mixup/cutmix (they carry the label
    smoothing then, so the loss does not smooth them twice)."""
    if manifest.multilabel:
        return nn.BCEWithLogitsLoss(pos_weight=torch.tensor(manifest.pos_weight(), device=device))
    weights = torch.tensor(manifest.class_weights(), device=device) if cfg.class_weighted_loss else None
    from fastpipe.loaders.augment import mixes

    return nn.CrossEntropyLoss(weight=weights, label_smoothing=0.0 if mixes(cfg.augment) else cfg.label_smoothing)


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


def train_from_cli(given: dict) -> Path:
    """The CLI's settings → a run. With --resume, the run's saved settings are the base and the flags typed may
    change only what a resume may change (config.RESUMABLE_CHANGES)."""
    if not given.get("resume"):
        return train(TrainConfig(**given))
    if not given.get("out"):
        raise ConfigError("--resume needs --out RUN_FOLDER: the run to continue")
    return train(resumed_config(Run(Path(given["out"])).saved_settings(), given, given["out"]))


def _check_resume(cfg: TrainConfig, run: Run) -> None:
    saved = run.saved_settings()
    differ = {k: (saved.get(k), v) for k, v in asdict(cfg).items()
              if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v}
    if differ:
        what = ", ".join(f"{k} {new!r} (the run has {old!r})" for k, (old, new) in differ.items())
        raise ConfigError(f"{run.path} was trained with other settings: {what}. Resume with the run's own settings "
                          f"(`fastpipe train DATA --out {run.path} --resume` takes them from its config.json), or "
                          f"start a new run with another --out")


def train(cfg: TrainConfig) -> Path:
    """Train cfg.model on cfg.data; returns the run folder."""
    cfg.validate()
    manifest = load(cfg.data, cache_dir=cfg.cache_dir, cache_limit=cfg.cache_limit)
    with distributed(cfg.device) as (d, device):
        return _train(cfg, manifest, d, device)


def _train(cfg: TrainConfig, manifest, d: Dist, device: torch.device) -> Path:
    chosen = cfg.normalize is None
    cfg = resolve(cfg, device)
    mean, std = normalization(cfg.normalize, manifest.mean, manifest.std)
    if chosen and cfg.pretrained and d.main:
        print(f"--pretrained: inputs normalised as the weights were trained ({weights_said(cfg)}: mean "
              f"{', '.join(f'{x:.3f}' for x in mean)}, std {', '.join(f'{x:.3f}' for x in std)}); "
              f"--normalize dataset uses the data set's own")
    run = Run(Path(cfg.out))
    if cfg.resume:
        _check_resume(cfg, run)
    elif d.main:
        run.refuse_existing()
    if cfg.auto_batch:
        cfg = _auto_batch(cfg, manifest, device)
    model = _build(cfg, manifest, device, d)
    has_val = bool(manifest.splits.get("val") and manifest.splits["val"].samples)
    val_size = image_size_for_epoch(cfg, cfg.epochs - 1)
    val_loader = make_loader_from(manifest, replace(_loader_cfg(cfg, "val", val_size, cfg.batch_size),
                                                    with_keys=True)) if has_val else None
    loaders: dict[int, object] = {}

    def train_loader(size: int):
        if size not in loaders:
            loaders[size] = make_loader_from(manifest, _loader_cfg(cfg, "train", size, cfg.batch_size))
        return loaders[size]

    steps = len(train_loader(image_size_for_epoch(cfg, 0))) // cfg.accum_steps
    opt = make_optimizer(model, cfg)
    trainer = Trainer(cfg, model, opt, make_schedule(opt, cfg, steps),
                      torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16"), _criterion(cfg, manifest, device),
                      device, d, normalization=normalize_text(mean, std), card=_card(cfg, manifest, mean, std))
    start = Start()
    if cfg.resume and (state := run.load()) is not None:
        start = _restore(trainer, state, run)
    if start.epoch >= cfg.epochs:  # every epoch trained: nothing to run, and no record to change
        if d.main:
            print(f"{run.path} is finished: {cfg.epochs} of {cfg.epochs} epochs trained, nothing to resume. To train "
                  f"it further: fastpipe train {cfg.data} --out {run.path} --resume --epochs N (N above {cfg.epochs})")
        return run.path
    if d.main:
        if not has_val:
            print("no validation split in the data set: training without evaluation", file=sys.stderr)
        run.start({"train": asdict(cfg), "versions": versions(), "device": _device_info(device),
                   "world_size": d.world, "data": {"root": manifest.location, "classes": list(manifest.classes),
                                                   "mean": manifest.mean, "std": manifest.std},
                   "normalization": {"setting": cfg.normalize, "mean": mean, "std": std}, "inference": trainer.card,
                   "loader": train_loader(image_size_for_epoch(cfg, 0)).describe()})
        run.truncate_metrics(start.epoch, trainer.global_step)
        run.open_board(trainer.global_step + 1 if cfg.resume else None)
        trainer.log_step = run.log
    trainer.checkpoint = lambda epoch, progress, loader: _save_mid(trainer, run, epoch, progress, loader)
    with trainer.stop:  # SIGINT/SIGTERM from here on: the current step finishes, a checkpoint, then a clean exit
        return _epochs(trainer, run, manifest, train_loader, val_loader, start, d)


def _card(cfg: TrainConfig, manifest, mean, std) -> dict:
    """How to use the weights on new photos: the data set's image step and the val transform (modelcard.py)."""
    from fastpipe.loaders import cpu_ops
    from fastpipe.train import modelcard

    val = LoaderConfig()  # the val transform: the loaders' defaults, which training uses
    return modelcard.make(cfg.model, manifest.classes, manifest.task, image_size_for_epoch(cfg, cfg.epochs - 1),
                          mean, std, cfg.amp, modelcard.convert_settings(manifest.settings, manifest.foreign),
                          val.val_crop, val.cpu_decoder, backend=cfg.backend,
                          decoder=cpu_ops.active(val.cpu_decoder) if cfg.backend == "torch" else "",
                          weights=pretrained_origin(cfg.model, cfg.pretrained))


@dataclass(frozen=True)
class Start:
    """Where a run (re)starts: an epoch, and within it the loader state and progress of a mid-epoch checkpoint."""

    epoch: int = 0
    loader: dict | None = None
    progress: EpochProgress | None = None


def _restore(trainer: Trainer, state: dict, run: Run) -> Start:
    """The model, optimizer and RNG state of the checkpoint, and where to start. A checkpoint that does not fit this
    run (an edited epoch, a tensor of another shape or one too many, another optimizer's state, a short RNG state,
    an unknown progress field) is one error naming the file; nothing in it is run (Run.load: weights_only)."""
    try:
        epoch = check_number("its epoch", state["epoch"], int, 0, trainer.cfg.epochs - 1)
        check_number("its global_step", state.get("global_step", 0), int, 0)
        mid = state.get("mid_epoch")
        progress = _progress(mid["progress"]) if mid else None
        trainer.restore(state)
    except (ConfigError, RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise RunError(f"{run.checkpoint_path} does not fit this run ({' '.join(str(e).split())[:250]}): edited, "
                       f"damaged or another run's. Resume with the run's own settings, or start a new run with "
                       f"another --out") from None
    return Start(epoch, mid["loader"], progress) if mid else Start(epoch + 1)


def _progress(saved) -> EpochProgress:
    """A mid-epoch checkpoint's progress: known fields only, each a number >= 0."""
    names = {f.name for f in fields(EpochProgress)}
    if not isinstance(saved, dict) or set(saved) - names:
        raise ValueError(f"mid-epoch progress has unknown fields {sorted(set(saved) - names)[:3]}"
                         if isinstance(saved, dict) else "mid-epoch progress is not a record")
    for name, value in saved.items():
        check_number(f"progress {name}", value, int if name in ("step", "batches", "images") else float, 0)
    return EpochProgress(**saved)


def _save_mid(trainer: Trainer, run: Run, epoch: int, progress: EpochProgress, loader) -> None:
    """A checkpoint inside an epoch: the model and optimizer after this step, and where the epoch goes on."""
    if trainer.dist.main:
        run.save({**trainer.state(epoch), "mid_epoch": {"loader": loader.state_dict(), "progress": asdict(progress)}})


def _loader_words(m: dict) -> str:
    """'device-bound; loader: decode 1.32 ms/img': the verdict of the epoch's wait and the loader's leading stage."""
    stages, lead = m.get("loader_ms_per_image") or {}, m.get("loader_leading_stage")
    return m.get("verdict", "") + (f"; loader: {lead} {stages[lead]:.2f} ms/img" if lead in stages else "")


def _report(cfg: TrainConfig, m: dict, epoch: int, size: int) -> None:
    print(f"epoch {epoch + 1}/{cfg.epochs}  size {size}  loss {m['train_loss']:.3f}  "
          + (f"val acc {m['val_acc']:.3f}  " if "val_acc" in m else "")
          + (f"val mAP {m['val_map']:.3f} (exact {m['val_exact_match']:.3f})  " if "val_map" in m else "")
          + f"{m['img_per_s']:.0f} img/s{disturbed(m)}  data wait {100 * m['data_wait']:.0f}% ({_loader_words(m)})"
          + (f"  peak {m['peak_mem_mb']:.0f} MB" if m["peak_mem_mb"] else ""))


def _epochs(trainer: Trainer, run: Run, manifest, train_loader, val_loader, start: Start, d: Dist) -> Path:
    cfg, began, status, errors = trainer.cfg, time.time(), "failed", None
    last = min(cfg.epochs, start.epoch + cfg.stop_after) if cfg.stop_after else cfg.epochs
    try:
        for epoch in range(start.epoch, last):
            size = image_size_for_epoch(cfg, epoch)
            loader = train_loader(size)
            loader.set_epoch(epoch)
            resumed = start.progress if epoch == start.epoch else None
            if resumed is not None:
                try:
                    loader.load_state_dict(start.loader)
                except ConfigError as e:
                    raise RunError(f"{run.checkpoint_path}: {e}; start a new run with another --out") from None
            others = OthersClock()
            m = {"kind": "epoch", "epoch": epoch, "image_size": size, **trainer.train_epoch(loader, epoch, resumed),
                 "global_step": trainer.global_step, "others_cpu_pct": round(100 * others.share(), 1)}
            if d.main:
                run.save(trainer.state(epoch))  # the epoch is trained: saved before evaluating it
            if val_loader is not None:
                m.update(trainer.evaluate(val_loader, manifest.num_classes))
                errors = m.pop("errors", None)
                if d.main:
                    run.keep_best(m, trainer)
            if d.main:
                run.log(m)
                _report(cfg, m, epoch, size)
            trainer.stop_now()
        status = "finished" if last == cfg.epochs else f"stopped after epoch {last} (--stop-after); --resume continues"
    except KeyboardInterrupt as e:
        status = "interrupted (SIGTERM)" if getattr(e, "signal_name", "") == "SIGTERM" else "interrupted"
        if d.main:
            print(f"{status}: saved at step {trainer.global_step}; to continue: fastpipe train {cfg.data} "
                  f"--out {run.path} --resume", file=sys.stderr)
        raise
    except torch.OutOfMemoryError as e:
        status = "out of memory"
        raise TrainingStopped(OOM_ADVICE.format(model=cfg.model, size=cfg.image_size) + f"\n({e})") from e
    except TrainingStopped as e:
        status = f"stopped: {e}"
        raise
    except Exception as e:
        status = f"failed: {type(e).__name__}: {str(e)[:300]}"
        raise
    finally:
        if d.main:
            run.finish(_summary(run, cfg, status, time.time() - began, began, start.epoch), manifest.classes)
            if errors is not None:  # a validation pass ran
                said = write_errors(run.path, errors, val_loader.shards, manifest.classes)
                if said:
                    print(said)
    return run.path


def _summary(run: Run, cfg: TrainConfig, status: str, seconds: float, began: float, first_epoch: int) -> dict:
    """The run's figures, and its history: one record per invocation (how it started and ended), so that a run
    stopped by SIGTERM and resumed says so, and its minutes are those of every part."""
    ms = run.epochs()
    history = [h for h in run.previous_summary().get("history", []) if isinstance(h, dict)] if cfg.resume else []
    history.append({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)), "seconds": round(seconds, 1),
                    "from_epoch": first_epoch, "epochs_done": len(ms), "status": status,
                    "resumed": bool(cfg.resume)})
    accs = [m["val_acc"] for m in ms if "val_acc" in m]
    maps = [m for m in ms if "val_map" in m]
    multi = {"best_val_map": max(m["val_map"] for m in maps), "final_val_map": maps[-1]["val_map"],
             "final_exact_match": maps[-1]["val_exact_match"], "threshold": maps[-1]["threshold"]} if maps else {}
    return {"status": status, "epochs_done": len(ms), "best_val_acc": max(accs, default=None),
            "final_val_acc": accs[-1] if accs else None, **multi,
            **run_speed(ms),
            "data_wait_pct": 100 * sum(m["data_wait"] for m in ms) / len(ms) if ms else None,
            "peak_mem_mb": max((m["peak_mem_mb"] or 0 for m in ms), default=None) or None,
            "minutes": sum(float(h.get("seconds") or 0) for h in history) / 60, "model": cfg.model,
            "backend": cfg.backend, "run": str(run.path), "history": history}


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1)}
    return {"type": "cpu", "cores": os.cpu_count(), "name": platform.processor() or platform.machine()}

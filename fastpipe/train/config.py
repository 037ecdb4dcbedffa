"""TrainConfig: every setting of a training run, resolved once and written into the run folder."""

from __future__ import annotations

from dataclasses import dataclass

AMP_MODES = ("fp16", "bf16", "off")
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class TrainConfig:
    data: str  # a converter output folder (dataset.json inside)
    model: str = "resnet18"
    backend: str = "torch"
    epochs: int = 10
    batch_size: int = 64
    lr: float | None = None  # None: 0.1 x effective batch / 256 for SGD, 1e-3 for AdamW (loop.resolve)
    optimizer: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-5
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.1
    image_size: int = 224
    progressive: str | None = None  # "128:224": small images first, full size for the last epochs
    amp: str | None = None  # None: fp16 (+ GradScaler) on CUDA, off on CPU (loop.resolve)
    accum_steps: int = 1
    channels_last: bool | None = None  # None: on for CUDA
    checkpoint_activations: bool = False
    compile: bool = False
    device: str | None = None
    workers: int | None = None
    out: str | None = None  # run folder; None: runs/<timestamp>-<model>
    resume: bool = False
    stop_after: int | None = None  # leave (resumably) after this many epochs in this invocation: time-limited jobs
    seed: int = 0
    pretrained: str | None = None  # a local weights file (no downloads at run time)
    balance: bool = False
    class_weighted_loss: bool = False
    sync_bn: bool = False
    auto_batch: bool = False
    max_nonfinite: int = 5  # consecutive non-finite losses before the run stops
    log_every: int = 10  # steps between progress-bar updates (each one reads the loss: a host sync)

    def validate(self) -> None:
        if self.amp is not None and self.amp not in AMP_MODES:
            raise ValueError(f"--amp {self.amp}: use one of {', '.join(AMP_MODES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer}: use one of {', '.join(OPTIMIZERS)}")
        if self.accum_steps < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("--accum-steps, --epochs and --batch-size must be at least 1")
        if self.progressive:
            parse_progressive(self.progressive)


def parse_progressive(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--progressive {text!r}: use START:END image sizes, e.g. 128:224") from None
    if not 32 <= lo <= hi:
        raise ValueError(f"--progressive {text!r}: need 32 <= START <= END")
    return lo, hi


def image_size_for_epoch(cfg: TrainConfig, epoch: int) -> int:
    """Progressive resizing: a linear ramp from START to END (multiples of 32) over the first epochs, then
    END for the last quarter of the run (at least one epoch), as FFCV's ResNet recipes do."""
    if not cfg.progressive:
        return cfg.image_size
    lo, hi = parse_progressive(cfg.progressive)
    ramp = max(cfg.epochs - max(1, cfg.epochs // 4), 1)
    if epoch >= ramp:
        return hi
    size = lo + (hi - lo) * epoch / max(ramp - 1, 1)
    return int(min(hi, max(lo, round(size / 32) * 32)))

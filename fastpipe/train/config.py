"""TrainConfig: every setting of a training run, resolved once and written into the run folder."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from fastpipe.errors import ConfigError
from fastpipe.loaders import BACKEND_NAMES
from fastpipe.options import (
    MAX_IMAGE_SIZE,
    NORMALIZE_FORMS,
    SEED_MAX,
    check,
    opt,
    parse_gb,
    parse_normalize,
    parse_threads,
    parse_workers,
)
from fastpipe.store.urls import check_location

AMP_MODES = ("fp16", "bf16", "off")
OPTIMIZERS = ("sgd", "adamw")
# What a resumed run may change: how long it runs and where, not what it trains.
RESUMABLE_CHANGES = {"epochs", "stop_after", "workers", "threads", "resume", "out", "log_every", "device", "data",
                     "checkpoint_every", "cache_dir", "cache_limit"}


@dataclass(frozen=True)
class TrainConfig:
    data: str = opt(None, "converter output folder (dataset.json inside), or its URL (s3://, gs://, az://, "
                          "http(s)://, hf://datasets/ORG/NAME; credentials from the store's usual environment)",
                    positional=True)
    model: str = opt("resnet18", "torchvision model name (resnet18/50, mobilenet_v3_large, efficientnet_b0, "
                                 "convnext_tiny, vit_b_16, ...), or timm:NAME for any timm model (timm:resnet10t)")
    backend: str = opt("torch", "loader backend", choices=BACKEND_NAMES)
    epochs: int = opt(10, "epochs in the whole run", low=1, high=100_000)
    batch_size: int = opt(64, "images per device and step (per micro-batch with --accum-steps)", low=1, high=65536)
    lr: float | None = opt(None, "learning rate (default: 0.1 x effective batch / 256 for SGD, 1e-3 for AdamW)",
                           above=0, high=100)
    optimizer: str = opt("sgd", "optimizer", choices=OPTIMIZERS)
    momentum: float = opt(0.9, "SGD momentum", low=0, below=1)
    nesterov: bool = opt(True, "Nesterov momentum (SGD)")
    weight_decay: float = opt(5e-5, "weight decay (not on norms and biases)", low=0, high=1)
    warmup_epochs: float = opt(1.0, "linear warm-up epochs before the cosine decay", low=0, high=100_000)
    label_smoothing: float = opt(0.1, "label smoothing of the cross-entropy loss (single-label data)", low=0,
                                  below=1)
    augment: str | None = opt(None, "augmentation on the device, e.g. randaug:2:9,mixup:0.2,cutmix:1.0 (randaug:N:M, "
                                    "trivialaug, jitter:B:C:S[:H], erase:P, mixup:A[:P], cutmix:A[:P])")
    image_size: int = opt(224, "training image size (pixels, square)", low=16, high=MAX_IMAGE_SIZE)
    progressive: str | None = opt(None, "START:END, e.g. 128:224: small images first, full size at the end")
    amp: str | None = opt(None, "mixed precision (default: fp16 + GradScaler on CUDA, off on a CPU)",
                          choices=AMP_MODES)
    accum_steps: int = opt(1, "gradient accumulation: optimizer step every N micro-batches, loss / N "
                              "(BatchNorm still sees only the micro-batch)", low=1, high=4096)
    channels_last: bool | None = opt(None, "channels_last memory format (default: on CUDA)")
    checkpoint_activations: bool = opt(False, "recompute the deep stages' activations in the backward pass")
    compile: bool = opt(False, "torch.compile the model")
    device: str | None = opt(None, "cuda, cuda:1, cpu (default: cuda when available)")
    workers: int | str | None = opt(None, "loader workers: a number (0 = in this process), auto (cores per device "
                                          "less one) or probe (measured once, cached)", parse=parse_workers,
                                 low=0, high=1024)
    threads: bool | str | None = opt(None, "loader workers as threads of the training process (on), processes "
                                           "(off) or threads in one helper process (helper); default auto: threads "
                                           "where the JPEG decoder releases the GIL, processes from the second epoch "
                                           "where the step's Python never pauses (fastpipe doctor says which)",
                                     parse=parse_threads)
    out: str | None = opt(None, "run folder (default runs/<time>-<model>)")
    resume: bool = opt(False, "continue the run in --out from its last checkpoint, with its saved settings")
    stop_after: int | None = opt(None, "leave after N epochs of this invocation (resumable), for time-limited jobs",
                                  low=1)
    checkpoint_every: int | None = opt(None, "also save last.pt every N optimizer steps (mid-epoch; SIGTERM and "
                                             "Ctrl-C always save one)", low=1)
    cache_dir: str | None = opt(None, "remote data (s3://, gs://, az://, http(s)://, hf://): this node's shard cache "
                                      "(default ~/.cache/fastpipe/shards or $FASTPIPE_CACHE)")
    cache_limit: str | None = opt(None, "remote data: keep the shard cache under this size, e.g. 50GB "
                                        "(least recently used shards go first; default: no limit)")
    seed: int = opt(0, "seed for the model, the data order and the augmentations", low=0, high=SEED_MAX)
    pretrained: str | None = opt(None, "weights to start from: a local file (.pth, .pt, .safetensors), or zoo "
                                       "(zoo:TAG) for the model zoo's own from this machine's cache (never "
                                       "downloaded): torchvision's weights enum, timm's pretrained tag")
    normalize: str | None = opt(None, f"input normalisation: {NORMALIZE_FORMS}, or pretrained (the weights' own). "
                                      f"Default: pretrained with --pretrained, else the data set's",
                                parse=lambda v: train_normalize(v))
    balance: bool = opt(False, "class-balanced sampling")
    class_weighted_loss: bool = opt(False, "weight the loss by the class weights")
    sync_bn: bool = opt(False, "SyncBatchNorm across ranks")
    auto_batch: bool = opt(False, "find the largest batch that fits before training (CUDA)")
    max_nonfinite: int = opt(5, "consecutive non-finite losses before the run stops", low=1, high=1_000_000)
    log_every: int = opt(10, "steps between progress updates (each reads the loss: a host sync)", low=1,
                         high=1_000_000)

    def __post_init__(self):
        object.__setattr__(self, "normalize", train_normalize(self.normalize))  # its forms in one (a pair: text)
        check(self)  # every setting's type and range, for the CLI and the Python API alike
        check_location(self.data)

    def validate(self) -> None:
        """What one setting's range cannot say: settings that depend on each other, and the text formats."""
        if self.resume and not self.out:
            raise ConfigError("--resume needs --out RUN_FOLDER: the run to continue")
        if self.progressive:
            parse_progressive(self.progressive)
        if self.augment:
            from fastpipe.loaders.augment import parse

            parse(self.augment)


def train_normalize(value) -> str | None:
    """A normalisation that training can use, in its one form (None: chosen when the run starts)."""
    if value is None or value == "pretrained":  # the weights' own: known when the run starts (session.resolve)
        return value
    try:
        value = parse_normalize(value)
    except ConfigError as e:
        raise ConfigError(f"{e} (or, for training, pretrained: the weights' own)") from None
    if value is False:
        raise ConfigError("--normalize False: uint8 images are for make_loader only; training takes "
                          f"{NORMALIZE_FORMS}")
    return value


def resumed_config(saved: dict, given: dict, run: str) -> TrainConfig:
    """The settings of a resumed run: the saved ones, with only what a resume may change taken from `given` (the
    flags the user typed). Anything else that differs is refused, naming each difference, instead of
    half-loading a checkpoint for another model or rewriting the run's record."""
    names = {f.name for f in fields(TrainConfig)}
    base = {k: v for k, v in saved.items() if k in names}
    base.setdefault("normalize", "dataset")  # runs recorded before the setting normalised with the data set's
    if given.get("normalize") == "pretrained" and base.get("pretrained"):  # the weights' own, as the run recorded
        from fastpipe.train.models import pretrained_normalization

        given = {**given, "normalize": pretrained_normalization(base["model"], base["pretrained"])}
    differ = {k: (base.get(k), v) for k, v in given.items() if k not in RESUMABLE_CHANGES and base.get(k) != v}
    if differ:
        what = ", ".join(f"--{k.replace('_', '-')} {new} (the run has {old})" for k, (old, new) in differ.items())
        raise ConfigError(f"{run} was trained with other settings: {what}. Resume with the run's own settings "
                          f"(drop those flags), or start a new run with another --out")
    try:
        return TrainConfig(**{**base, **given, "resume": True})
    except ConfigError as e:
        raise ConfigError(f"{run}/config.json: {e} (the file was edited or damaged); restore it, or start a new run "
                          f"with another --out") from None


def parse_progressive(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--progressive {text!r}: use START:END image sizes, e.g. 128:224") from None
    if not 32 <= lo <= hi <= MAX_IMAGE_SIZE:
        raise ConfigError(f"--progressive {text!r}: need 32 <= START <= END <= {MAX_IMAGE_SIZE}")
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


@dataclass(frozen=True)
class MemoryConfig:
    model: str = opt("resnet18", "torchvision model name, or timm:NAME")
    image_size: int = opt(224, "image size (pixels, square)", low=16, high=MAX_IMAGE_SIZE)
    batch_size: int = opt(64, "batch size to account for", low=1, high=65536)
    optimizer: str = opt("sgd", "optimizer (SGD keeps one state copy, AdamW two)", choices=("sgd", "adamw"))
    amp: str | None = opt(None, "mixed precision (default as `fastpipe train`: fp16 on CUDA, off on a CPU)",
                          choices=("fp16", "bf16", "off"))
    num_classes: int = opt(1000, "classes of the head (or --data)", low=1, high=1_000_000)
    device: str | None = opt(None, "where to measure (default: cuda when available)")
    gpu_memory: int | None = opt(None, "memory to plan for, e.g. 8GB (a bare 8 means 8 GB; default: this GPU's)",
                                 parse=parse_gb)
    checkpoint_activations: bool = opt(False, "recompute the deep stages' activations")
    channels_last: bool = opt(True, "channels_last memory format")

    def __post_init__(self):
        check(self)

    def resolved(self) -> MemoryConfig:
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return replace(self, device=device, amp=self.amp or ("fp16" if device.startswith("cuda") else "off"))

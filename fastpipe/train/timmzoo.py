"""timm's classifiers by name (`--model timm:NAME[.TAG]`): any name timm.list_models() knows, with a pretrained tag
if wanted (`timm:resnet50.a1_in1k`: `--pretrained zoo` then takes those weights, zoo.py), built without pretrained
weights (those come from --pretrained) with the head sized to the data set. timm is imported here only, on first
use: `pip install 'fastpipe[timm]'`."""

from __future__ import annotations

import re

from torch import nn

from fastpipe.errors import ConfigError, MissingDependency

PREFIX = "timm:"
NAME = re.compile(r"(?P<arch>[A-Za-z][A-Za-z0-9_]*)(?:\.(?P<tag>[A-Za-z0-9_]+))?")  # timm's names, a tag after a dot


def is_timm(name: str) -> bool:
    return name.startswith(PREFIX)


def build(name: str, num_classes: int, image_size: int, weights=None) -> nn.Module:
    """timm:NAME with `num_classes` outputs, for images of `image_size` (models with a fixed input size, such as
    ViTs, are made for it); with `weights` (the zoo's cached file for its pretrained tag), loaded by timm's own
    loader, which adapts them as it does its downloads: the classifier left for the data set's classes, a ViT's
    position embedding resampled to the image size."""
    timm = _timm()
    model_name = name[len(PREFIX) :]
    m = NAME.fullmatch(model_name)
    if not m or m["arch"] not in timm.list_models():
        close = timm.list_models(f"*{m['arch'][:12]}*")[:5] if m else []
        raise ConfigError(f"unknown model {name!r}: not a name timm.list_models() gives (timm {timm.__version__})"
                          + (f"; close: {', '.join(PREFIX + c for c in close)}" if close else ""))
    if m["tag"] and model_name not in timm.list_pretrained(f"{m['arch']}.*"):
        tags = timm.list_pretrained(f"{m['arch']}.*")[:6]
        raise ConfigError(f"unknown pretrained tag in {name!r}: timm has " + (", ".join(PREFIX + t for t in tags)
                                                                               or f"no pretrained {m['arch']}"))
    made = {"pretrained": weights is not None, "num_classes": num_classes,
            **({"pretrained_cfg_overlay": {"file": str(weights)}} if weights is not None else {})}
    try:
        model = timm.create_model(model_name, img_size=image_size, **made)
    except TypeError:  # a model of any input size takes no img_size
        model = timm.create_model(model_name, **made)
    if weights is not None:
        print(f"--pretrained zoo: timm's {model.pretrained_cfg.get('hf_hub_id') or model_name} weights from {weights}, "
              f"the classifier made for {num_classes} classes")
    return model


def checkpoint_deep_stages(model: nn.Module) -> list[str]:
    """timm's own activation checkpointing (every timm model has set_grad_checkpointing)."""
    try:
        model.set_grad_checkpointing(True)
    except (AttributeError, NotImplementedError, AssertionError):
        raise ConfigError(f"{type(model).__name__} (timm) does not support activation checkpointing: leave out "
                          f"--checkpoint-activations") from None
    return ["all (timm's set_grad_checkpointing)"]


def _timm():
    try:
        import timm
    except ImportError:
        raise MissingDependency("timm models need timm: pip install 'fastpipe[timm]'") from None
    return timm

"""timm's classifiers by name (`--model timm:NAME`): any name timm.list_models() knows, built without pretrained
weights (those come from --pretrained FILE) with the head sized to the data set. timm is imported here only, on
first use: `pip install 'fastpipe[timm]'`."""

from __future__ import annotations

import re

from torch import nn

from fastpipe.errors import ConfigError, MissingDependency

PREFIX = "timm:"
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # timm's model names (a pretrained tag after a dot is not a model)


def is_timm(name: str) -> bool:
    return name.startswith(PREFIX)


def build(name: str, num_classes: int, image_size: int) -> nn.Module:
    """timm:NAME with `num_classes` outputs, for images of `image_size` (models with a fixed input size, such as
    ViTs, are made for it)."""
    timm = _timm()
    model_name = name[len(PREFIX) :]
    if not NAME.fullmatch(model_name) or model_name not in timm.list_models():
        close = timm.list_models(f"*{model_name[:12]}*")[:5] if NAME.fullmatch(model_name) else []
        raise ConfigError(f"unknown model {name!r}: not a name timm.list_models() gives (timm {timm.__version__})"
                          + (f"; close: {', '.join(PREFIX + c for c in close)}" if close else "")
                          + "; a pretrained tag (.augreg_in21k) is not part of the name: give weights with "
                            "--pretrained")
    try:
        return timm.create_model(model_name, pretrained=False, num_classes=num_classes, img_size=image_size)
    except TypeError:  # a model of any input size takes no img_size
        return timm.create_model(model_name, pretrained=False, num_classes=num_classes)


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

"""torchvision classifiers by name (timm's with timm:NAME, timmzoo.py), with the head sized to the data set and
optional activation checkpointing."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastpipe.errors import ConfigError
from fastpipe.options import NORMALIZE_FORMS, normalize_text, parse_normalize
from fastpipe.train import timmzoo, zoo

SUPPORTED = ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v3_small", "mobilenet_v3_large",
             "efficientnet_b0", "efficientnet_b1", "convnext_tiny", "vit_b_16", "regnet_y_400mf")


def _checkpointed(block: nn.Module) -> None:
    """Recompute this block's activations in the backward pass instead of keeping them. The block's own forward is
    wrapped in place, not the block in another module, so the weights keep torchvision's names: a checkpoint of a
    run trained this way loads into a plain torchvision model."""
    plain = block.forward

    def forward(x):
        if block.training and torch.is_grad_enabled():
            return checkpoint(plain, x, use_reentrant=False)
        return plain(x)

    block.forward = forward


def plain_names(state: dict, model: nn.Module) -> dict:
    """A state dict with the names of this model: checkpoints of runs with --checkpoint-activations made before
    the stages were wrapped in place carry a '.block' in the stages' names."""
    own = model.state_dict()
    if all(k in own for k in state):
        return state
    return {(k.replace(".block.", ".", 1) if k not in own and k.replace(".block.", ".", 1) in own else k): v
            for k, v in state.items()}


def _deep_blocks(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The container and names of the deeper stages. Only those are checkpointed (the seed's advice): the early,
    high-resolution stages would cost the most to recompute."""
    if hasattr(model, "layer4"):  # ResNet: stages 3 and 4
        return model, ["layer3", "layer4"]
    if hasattr(model, "encoder") and hasattr(model.encoder, "layers"):  # ViT: the second half of the blocks
        layers = model.encoder.layers
        names = [n for n, _ in layers.named_children()]
        return layers, names[len(names) // 2 :]
    if hasattr(model, "features"):  # MobileNet, EfficientNet, ConvNeXt: the second half of `features`
        names = [n for n, _ in model.features.named_children()]
        return model.features, names[len(names) // 2 :]
    if hasattr(model, "trunk_output"):  # RegNet
        names = [n for n, _ in model.trunk_output.named_children()]
        return model.trunk_output, names[len(names) // 2 :]
    raise ConfigError(f"no known stage layout for {type(model).__name__}: --checkpoint-activations unsupported")


def checkpoint_deep_stages(model: nn.Module) -> list[str]:
    parent, names = _deep_blocks(model)
    for name in names:
        _checkpointed(getattr(parent, name))
    return names


def _read_weights(file: Path):
    """A weights file's tensors, without running any code it holds: safetensors, or torch's weights_only."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file), device="cpu")
    return torch.load(file, map_location="cpu", weights_only=True)


def load_pretrained(model: nn.Module, path: str) -> list[str]:
    """Weights from a local file (a state dict, or a fastpipe checkpoint's "model"); tensors whose name or shape
    does not match (the classifier head of another class count) are left as initialised, and a file of which
    nothing matches is refused. Loaded with weights_only: a crafted file cannot run code. Returns the names of
    the tensors not loaded."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--pretrained {path}: no such file (fastpipe never downloads weights; save them once on "
                          f"a machine with a network, or say --pretrained zoo for the zoo's cached ones)")
    try:
        state = _read_weights(file)
    except Exception as e:  # damage and foreign pickles raise many types; all mean the same here
        raise ConfigError(f"--pretrained {path}: not a weights file that can be loaded safely ({type(e).__name__}: "
                          f"{str(e)[:150]}); save one with torch.save(model.state_dict(), FILE)") from None
    state = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ConfigError(f"--pretrained {path}: holds a {type(state).__name__}, not a state dict (names → "
                          f"tensors); save one with torch.save(model.state_dict(), FILE)")
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise ConfigError(f"--pretrained {path}: none of its {len(state)} tensors matches a {type(model).__name__}'s "
                          f"names and shapes: weights of another model? (--model must be the one they were saved from)")
    model.load_state_dict(usable, strict=False)
    missing = sorted(set(own) - set(usable))
    print(f"--pretrained {path}: loaded {len(usable)} of the model's {len(own)} tensors"
          + (f"; left as initialised: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else ""))
    return missing


def pretrained_origin(model: str, pretrained: str | None) -> str:
    """What a run started from, for its model card: the zoo's weights by name and tag, a file by its name (its
    folder may be private), or "" from scratch."""
    if not pretrained:
        return ""
    if zoo.is_zoo(pretrained):
        return zoo.describe(model, pretrained)
    return f"file {Path(pretrained).name}"


def weights_said(cfg) -> str:
    """The weights a run's inputs are normalised for, as its first line names them."""
    if zoo.is_zoo(cfg.pretrained):
        return pretrained_origin(cfg.model, cfg.pretrained)
    return "imagenet" if cfg.normalize == "imagenet" else f"as recorded in {Path(cfg.pretrained).name}"


def pretrained_normalization(model: str, pretrained: str) -> str:
    """`--normalize pretrained`: the chosen weights' own mean/std, as the setting's text (recorded in the run). The
    zoo's weights are looked for now, before anything is said of them."""
    if zoo.is_zoo(pretrained):
        zoo.weights_file(model, pretrained)
        return normalize_text(*zoo.mean_std(model, pretrained))
    return weights_normalization(pretrained)


def weights_normalization(path: str) -> str:
    """The normalisation the weights in `path` were trained with, the one fine-tuning them needs: a fastpipe
    checkpoint records its own (its `normalize`); other weights files (torchvision's and timm's ImageNet weights)
    were trained with ImageNet's mean/std."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: no tensor is read
    except Exception:  # damage and foreign pickles raise many types: load_pretrained names the file
        return "imagenet"
    recorded = state.get("normalize") if isinstance(state, dict) else None
    if recorded is None:
        return "imagenet"
    try:
        return parse_normalize(recorded)
    except ConfigError:
        raise ConfigError(f"--pretrained {path}: its recorded normalisation {str(recorded)[:60]!r} is not one: a "
                          f"damaged checkpoint? Give --normalize ({NORMALIZE_FORMS})") from None


def build_model(name: str, num_classes: int, image_size: int = 224, pretrained: str | None = None,
                checkpoint_activations: bool = False) -> nn.Module:
    """A torchvision classifier by name, or timm's (timm:NAME), with `num_classes` outputs."""
    if timmzoo.is_timm(name):
        model = timmzoo.build(zoo.tagged(name, pretrained), num_classes, image_size,
                              zoo.weights_file(name, pretrained) if zoo.is_zoo(pretrained) else None)
        if pretrained and not zoo.is_zoo(pretrained):
            load_pretrained(model, pretrained)
        if checkpoint_activations:
            timmzoo.checkpoint_deep_stages(model)
        return model
    if name not in torchvision.models.list_models(module=torchvision.models):  # detection, video...: not classifiers
        raise ConfigError(f"unknown model {name!r}: not a torchvision classification model; try one of "
                          f"{', '.join(SUPPORTED)} (any name torchvision.models.list_models(module=torchvision.models) "
                          f"gives works)")
    try:
        kwargs = {"image_size": image_size} if name.startswith("vit") else {}
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    except ValueError:
        raise ConfigError(f"unknown model {name!r}: try one of {', '.join(SUPPORTED)} "
                         f"(any torchvision classification model name works)") from None
    if pretrained:
        load_pretrained(model, str(zoo.weights_file(name, pretrained)) if zoo.is_zoo(pretrained) else pretrained)
    if checkpoint_activations:
        checkpoint_deep_stages(model)
    return model

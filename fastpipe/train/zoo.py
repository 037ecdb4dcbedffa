"""Pretrained weights from a model zoo's own cache: `--pretrained zoo` (or `zoo:TAG`). fastpipe never downloads
weights: it takes the file the zoo already keeps on this machine, or says in one line how to get it there.

- torchvision: the model's weights enum, DEFAULT or the TAG named (`zoo:IMAGENET1K_V2`), from torch.hub's
  checkpoint folder (`$TORCH_HOME/hub/checkpoints`, where `torchvision.models.resnet50(weights=...)` saved it).
- timm: the pretrained tag in the model's name (`--model timm:resnet50.a1_in1k`), or `zoo:TAG`, or timm's default
  tag for the architecture, from the Hugging Face cache (`$HF_HUB_CACHE`, where `timm.create_model(...,
  pretrained=True)` saved it).

`mean_std` is the chosen weights' own input normalisation (`--normalize pretrained`): timm's pretrained config
(several timm weights use 0.5/0.5, not ImageNet's), torchvision's transforms.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from fastpipe.errors import ConfigError, MissingDependency
from fastpipe.train import timmzoo

ZOO = "zoo"


def is_zoo(pretrained: str | None) -> bool:
    return isinstance(pretrained, str) and (pretrained == ZOO or pretrained.startswith(ZOO + ":"))


def _tag(pretrained: str) -> str | None:
    return pretrained.split(":", 1)[1] or None if ":" in pretrained else None


def tagged(model: str, pretrained: str | None) -> str:
    """timm:ARCH.TAG for `--pretrained zoo:TAG` of a timm model (the tag's own config builds it), else `model`."""
    tag = _tag(pretrained) if is_zoo(pretrained) else None
    if not tag or not timmzoo.is_timm(model):
        return model
    return f"{model.split('.', 1)[0]}.{tag}"


def describe(model: str, pretrained: str) -> str:
    """The zoo's weights by name: timm's hub id with its tag (timm/resnet50.a1_in1k), torchvision's enum member
    (ResNet50_Weights.IMAGENET1K_V2)."""
    if timmzoo.is_timm(model):
        return _timm_cfg(model, _tag(pretrained)).hf_hub_id
    return str(_torchvision_weights(model, _tag(pretrained)))


def weights_file(model: str, pretrained: str) -> Path:
    """The zoo's cached weights file for `model` and `--pretrained zoo[:TAG]`; ConfigError when not there."""
    if timmzoo.is_timm(model):
        return _timm_file(model, _tag(pretrained))
    weights = _torchvision_weights(model, _tag(pretrained))
    import torch.hub

    file = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlsplit(weights.url).path)
    if not file.is_file():
        raise ConfigError(f"--pretrained {pretrained}: torchvision's {weights} for {model} is not in this machine's "
                          f"cache ({file}); fastpipe never downloads weights: on a machine with a network run "
                          f"`python -c \"import torchvision; torchvision.models.get_model('{model}', "
                          f"weights='{weights.name}')\"` and copy {file.name} there, or give --pretrained FILE")
    return file


def mean_std(model: str, pretrained: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The input normalisation the zoo's weights were trained with."""
    if timmzoo.is_timm(model):
        cfg = _timm_cfg(model, _tag(pretrained))
        return tuple(map(float, cfg.mean)), tuple(map(float, cfg.std))
    transforms = _torchvision_weights(model, _tag(pretrained)).transforms()
    return tuple(map(float, transforms.mean)), tuple(map(float, transforms.std))


def _torchvision_weights(model: str, tag: str | None):
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(model)
    except (ValueError, KeyError):
        raise ConfigError(f"--pretrained zoo: torchvision has no weights for {model!r}") from None
    try:
        return enum.DEFAULT if tag is None else enum[tag]
    except KeyError:
        raise ConfigError(f"--pretrained zoo:{tag}: torchvision has no weights {tag!r} for {model}; it has "
                          f"{', '.join(w.name for w in enum)}") from None


def _timm_cfg(model: str, tag: str | None):
    timm = timmzoo._timm()
    name = model[len(timmzoo.PREFIX):]
    if tag and "." in name and name.split(".", 1)[1] != tag:
        raise ConfigError(f"--pretrained zoo:{tag} and --model {model} name two pretrained tags: give one")
    if tag:
        name = f"{name.split('.', 1)[0]}.{tag}"
    try:
        cfg = timm.models.get_pretrained_cfg(name)
    except RuntimeError:  # a known architecture, an unknown tag
        cfg = None
    if cfg is None or not cfg.hf_hub_id:
        tags = timm.list_pretrained(f"{name.split('.', 1)[0]}.*")[:6]
        raise ConfigError(f"--pretrained zoo{':' + tag if tag else ''}: timm knows no pretrained weights {name!r}"
                          + (f"; it has {', '.join(tags)}" if tags else ""))
    return cfg


def _timm_file(model: str, tag: str | None) -> Path:
    cfg = _timm_cfg(model, tag)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise MissingDependency("timm's weights are kept in the Hugging Face cache: pip install huggingface_hub"
                                ) from None
    for filename in ("model.safetensors", "pytorch_model.bin"):
        found = try_to_load_from_cache(cfg.hf_hub_id, filename)
        if isinstance(found, str):
            return Path(found)
    from huggingface_hub.constants import HF_HUB_CACHE

    raise ConfigError(f"--pretrained zoo: timm's weights {cfg.hf_hub_id} are not in this machine's Hugging Face "
                      f"cache ({HF_HUB_CACHE}); fastpipe never downloads weights: on a machine with a network run "
                      f"`python -c \"import timm; timm.create_model('{cfg.hf_hub_id.split('/', 1)[1]}', "
                      f"pretrained=True)\"` and copy its cache folder's models--{cfg.hf_hub_id.replace('/', '--')} "
                      f"into {HF_HUB_CACHE}, or give --pretrained FILE")


__all__ = ["ZOO", "describe", "is_zoo", "mean_std", "tagged", "weights_file"]

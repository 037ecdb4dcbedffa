"""Interchangeable loaders behind one contract (see base.py); `make_loader` maps a name to a backend."""

from __future__ import annotations

import importlib
import os
from dataclasses import fields

from fastpipe.errors import ConfigError
from fastpipe.loaders.config import LoaderConfig
from fastpipe.manifest import Manifest, load

# name → "module:class"; imported on demand so that DALI is only imported when asked for.
BACKENDS = {
    "torch": "fastpipe.loaders.cpu:TorchLoader",
    "dali": "fastpipe.loaders.dali:DaliLoader",
    "nvjpeg": "fastpipe.loaders.nvjpeg:NvjpegLoader",
    "synthetic": "fastpipe.loaders.synthetic:SyntheticLoader",
}
BACKEND_NAMES = tuple(BACKENDS)


def backend_class(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"unknown loader backend {name!r}: valid backends are {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_loader_from(manifest: Manifest, cfg: LoaderConfig, backend: str | None = None):
    from dataclasses import replace

    cfg = replace(cfg, backend=backend or cfg.backend)
    return backend_class(cfg.backend)(manifest, cfg)


def make_loader(out: str | os.PathLike, backend: str = "torch", **settings):
    """A loader over a converter output folder. Settings are LoaderConfig's fields (see config.py)."""
    valid = {f.name for f in fields(LoaderConfig)}
    unknown = sorted(set(settings) - valid)
    if unknown:
        raise ConfigError(f"unknown loader setting(s) {unknown}: valid are {sorted(valid - {'backend'})}")
    backend_class(backend)  # reject an unknown name before reading anything
    return make_loader_from(load(out), LoaderConfig(backend=backend, **settings))


__all__ = ["BACKENDS", "BACKEND_NAMES", "LoaderConfig", "make_loader", "make_loader_from"]

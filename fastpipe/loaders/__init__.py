"""Interchangeable loaders behind one contract (see base.py); `make_loader` maps a name to a backend."""

from __future__ import annotations

import importlib
import os
from dataclasses import fields

from fastpipe.dataset.loading import load
from fastpipe.dataset.manifest import Manifest
from fastpipe.errors import ConfigError
from fastpipe.loaders.config import LoaderConfig

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


def make_loader(out: str | os.PathLike, backend: str = "torch", *, storage_options: dict | None = None,
                cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None, **settings):
    """A loader over a converter output folder, or its URL in object storage (s3://, gs://, http(s)://, hf://...; read
    through a node-local cache in `cache_dir`, kept under `cache_limit`, e.g. "50GB"; `storage_options` are
    fsspec's, held in memory only). Settings are LoaderConfig's fields (see config.py)."""
    valid = {f.name for f in fields(LoaderConfig)}
    unknown = sorted(set(settings) - valid)
    if unknown:
        raise ConfigError(f"unknown loader setting(s) {unknown}: valid are {sorted(valid - {'backend'})} "
                          f"(and storage_options, cache_dir, cache_limit)")
    backend_class(backend)  # reject an unknown name before reading anything
    manifest = load(out, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
    return make_loader_from(manifest, LoaderConfig(backend=backend, **settings))


__all__ = ["BACKENDS", "BACKEND_NAMES", "LoaderConfig", "make_loader", "make_loader_from"]

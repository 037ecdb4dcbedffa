"""Tiny data sets made in tmp_path: the class is visible in the colour, so labels can be checked by eye."""

from __future__ import annotations

import io
import os
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm reads it once, at import: set before fastpipe imports it

import numpy as np
import pytest
import torch
from PIL import Image

# One hue per class: a loader that mixes up labels and images shows it in the mean colour.
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_dali = pytest.mark.skip(reason="needs NVIDIA DALI (pip install 'fastpipe[dali-cu13]')")
    skip_slow = pytest.mark.skip(reason="slow: run with -m slow")
    slow_asked = "slow" in (config.getoption("-m") or "")
    for item in items:
        if "slow" in item.keywords and not slow_asked:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "dali" in item.keywords and not has_dali():
            item.add_marker(skip_dali)


def photo(color, size=(96, 72), seed=0, fmt="JPEG", mode="RGB") -> bytes:
    """A noisy single-colour image (noise so that JPEGs of different seeds differ in bytes)."""
    rng = np.random.default_rng(seed)
    a = np.clip(np.array(color, float) + rng.normal(0, 12, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(a, "RGB")
    if mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_folder(root: Path, counts: dict[str, int], size=(96, 72), seed=0) -> Path:
    """ImageFolder tree: root/<class>/img_XXX.jpg with counts[class] files."""
    for k, (name, n) in enumerate(counts.items()):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (d / f"img_{i:03d}.jpg").write_bytes(photo(COLORS[name], size, seed=seed * 10_000 + k * 1000 + i))
    return root


def webdataset_shards(folder: Path, count: int, per_shard: int) -> list[Path]:
    """Shards another tool wrote (webdataset's ShardWriter): `count` photos of 3 classes, `cls` labels."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "part-%03d.tar"), maxcount=per_shard) as sink:
        for i in range(count):
            color = ("red", "green", "blue")[i % 3]
            sink.write({"__key__": f"s{i:04d}", "jpg": photo(COLORS[color], seed=i), "cls": str(i % 3).encode()})
    return sorted(folder.glob("part-*.tar"))


@pytest.fixture
def folder(tmp_path) -> Path:
    return make_folder(tmp_path / "src", {"red": 12, "green": 8, "blue": 4})


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Path:
    """A converted data set shared by read-only tests: 3 classes, several small shards per split."""
    from fastpipe.convert.driver import ShardConfig, shard

    base = tmp_path_factory.mktemp("converted")
    src = make_folder(base / "src", {"red": 40, "green": 30, "blue": 20}, size=(120, 90))
    out = base / "out"
    shard(ShardConfig(src, out, short_side=64, val_fraction=0.25, max_shard_size=64 * 1024, workers=1))
    return out


@pytest.fixture
def quick_retries(monkeypatch):
    """Store tests: a stalled request fails in 2 s, and faults get 8 attempts."""
    monkeypatch.setenv("FASTPIPE_REMOTE_ATTEMPTS", "8")
    monkeypatch.setenv("FASTPIPE_REMOTE_TIMEOUT", "2")


def epoch(loader):
    """(keys, labels, images) of one epoch of a loader made `with_keys=True`, in order."""
    keys, labels, images = [], [], []
    for x, y, k in loader:
        keys += [f"{s.shard}/{s.key}" for s in k]
        labels += y.tolist()
        images.append(x)
    return keys, labels, torch.cat(images)


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED", "0"))

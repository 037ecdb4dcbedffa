"""Tiny data sets made in tmp_path: the class is visible in the colour, so labels can be checked by eye."""

from __future__ import annotations

import io
import os
import signal
import tempfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm reads it once, at import: set before fastpipe imports it
# The record of this user's .pt2 exports (predict/trust.py): the suite's own, never the user's.
os.environ["FASTPIPE_HOME"] = tempfile.mkdtemp(prefix="fastpipe-home-")
# A shell starts a command run in the background (`cmd &`, nohup, some CI runners) with SIGINT ignored, and Python
# then never turns Ctrl-C into KeyboardInterrupt. The tests of Ctrl-C need it as a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
    skip_slow = pytest.mark.skip(reason="slow: run with scripts/test.sh --all (or -m slow)")
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


@pytest.fixture(scope="session")
def s3_bucket(converted):
    """moto's S3 server on loopback (the way s3fs's own tests run), with the converted set uploaded."""
    pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}
    fs = s3fs.S3FileSystem(**{**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": endpoint}},
                           skip_instance_cache=True)
    fs.call_s3("create_bucket", Bucket="leafs")
    fs.put(f"{converted}/", "leafs/sets/v1/", recursive=True)
    yield endpoint, opts
    server.stop()


def aws_env(monkeypatch, endpoint: str, tmp_path: Path) -> None:
    """The standard AWS environment pointing at moto's server (what every machine of a job reads a bucket with)."""
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "FASTPIPE_CACHE": str(tmp_path / "cache" / "shards")}.items():
        monkeypatch.setenv(k, v)


def messy_photos(root: Path, counts: dict[str, int], size=(64, 48)) -> dict:
    """A class-folder tree with one file for each rule discovery and conversion refuse by (empty, not an image, cut
    short, a duplicate, too many pixels, too many bytes, outside a class folder) and hidden files that are ignored.
    Returns the ShardConfig settings that make those rules bite."""
    make_folder(root, counts, size)
    big = photo(COLORS["green"], (size[0] * 2, size[1] * 2), seed=99)  # 4x the pixels of the others
    (root / "green" / "big.jpg").write_bytes(big)
    limit = len(big) + 1000
    (root / "red" / "empty.jpg").write_bytes(b"")
    (root / "green" / "notes.jpg").write_bytes(b"not an image at all")
    (root / "blue" / "cut.jpg").write_bytes(photo(COLORS["blue"], size, seed=98)[:400])
    (root / "red" / "copy.jpg").write_bytes((root / "red" / "img_000.jpg").read_bytes())
    (root / "blue" / "huge.jpg").write_bytes(np.random.default_rng(0).bytes(limit + 1))
    (root / "readme.txt").write_text("photos of leaves")
    (root / "red" / ".DS_Store").write_bytes(b"\0" * 10)
    (root / "__MACOSX").mkdir()
    (root / "__MACOSX" / "red.jpg").write_bytes(b"resource fork")
    return {"max_pixels": size[0] * size[1] * 2, "max_file_size": limit}


def tree(out: Path, skip=("dataset.json",)) -> dict[str, bytes]:
    """Every file a conversion wrote (not its lock), by path: shards, indexes, previews, rejections, manifest."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name not in skip}


def manifest_without_source(path: Path) -> dict:
    """dataset.json less the one field that says where SRC was (a folder here, a URL there)."""
    import json

    data = json.loads(Path(path).read_text())
    data["settings"].pop("source")
    return data

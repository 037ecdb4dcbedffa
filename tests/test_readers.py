"""Other readers read fastpipe's shards with no file written by hand and two workers, every sample with the label
fastpipe's own loader gives it: webdataset, wids, timm, Hugging Face datasets, DALI on the CPU, and Ray Data where
Ray is installed. Single- and multi-label data, converted with the default shard layout (--min-shards), each call
as the README gives it. A reader that is not installed is skipped, naming the package."""

from __future__ import annotations

import functools
import glob
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import COLORS, make_folder, photo
from PIL import Image

from fastpipe import make_loader
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.dataset.loading import load
from fastpipe.dataset.shardformat import read_index, read_member

# Hugging Face's libraries read these at import: nothing here may reach the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NAMES = ["rust", "scab", "mildew"]
SPLITS = ("train", "val")


def _convert(src, out: Path, seed: int = 0) -> Path:
    shard(ShardConfig(src, out, short_side=32, val_fraction=0.25, workers=1, seed=seed))  # default: --min-shards 8
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("single")
    return _convert(make_folder(base / "src", {"red": 10, "green": 8, "blue": 6}, size=(48, 36)), base / "out")


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> Path:
    """Most images have no label at all, and those of each split's first shard none: a reader that infers the label
    types from the first samples of a shard (Hugging Face) sees only empty label sets there."""
    base = tmp_path_factory.mktemp("multi")
    (base / "src").mkdir()
    rows = ["path,labels"]
    for i in range(36):  # every fourth image has one or two labels
        present = [NAMES[i // 4 % 3], *([NAMES[(i // 4 + 1) % 3]] if i % 8 == 0 else [])] if i % 4 == 0 else []
        (base / "src" / f"img_{i:03d}.jpg").write_bytes(photo(COLORS["red"], (48, 36), seed=i))
        rows.append(f'img_{i:03d}.jpg,"{";".join(present)}"')
    (base / "src" / "labels.csv").write_text("\n".join(rows) + "\n")
    return _convert(base / "src" / "labels.csv", base / "out", seed=10)  # seed 10: first shards of no labels


@pytest.fixture(params=["single", "multi"])
def data(request) -> Path:
    return request.getfixturevalue(request.param)


# -- what fastpipe's own loader says ----------------------------------------------------------------------------
@functools.cache
def reference(out: Path, split: str) -> dict[str, tuple]:
    """key -> (label, source file, digest of the decoded pixels) for every sample of a split: the label as
    fastpipe's loader yields it (a class index, or the multi-hot tuple), over one epoch that holds every sample."""
    loader = make_loader(out, split=split, batch_size=1, image_size=16, device="cpu", num_workers=0, with_keys=True)
    labels = {}
    for _, y, keys in loader:
        labels[keys[0].key] = (int(y[0]) if y.ndim == 1 else tuple(int(v) for v in y[0]), keys[0].source)
    m = load(out)
    assert len(labels) == m.splits[split].samples
    pixels = {}
    for s in m.splits[split].shards:
        with open(out / s.path, "rb") as fh:
            for key, parts in read_index(out / s.index):
                pixels[key] = _digest(Image.open(io.BytesIO(read_member(fh, parts["jpg"]))))
    return {k: (label, source, pixels[k]) for k, (label, source) in labels.items()}


def _digest(im) -> int:
    """A decoded image's pixels as one number (what identifies a sample that a reader hands over without its key)."""
    data = np.asarray(im.convert("RGB")).tobytes()
    return int.from_bytes(hashlib.sha1(data).digest()[:7], "little")


def _label(meta: dict, multilabel: bool):
    return tuple(meta["labels"]) if multilabel else meta["label"]


def _check(got: list[tuple[str, object]], ref: dict[str, tuple]) -> None:
    """Every sample once, each with fastpipe's label."""
    got = [(k, tuple(label) if isinstance(label, (list, tuple)) else label) for k, label in got]  # lists from a
    keys = [k for k, _ in got]  # DataLoader's collation
    assert sorted(keys) == sorted(ref), "a reader missed or repeated samples"
    wrong = [(k, label, ref[k][0]) for k, label in got if label != ref[k][0]]
    assert not wrong, f"labels that differ from fastpipe's (key, reader's, fastpipe's): {wrong[:5]}"


def _shards(out: Path, split: str) -> list[str]:
    return sorted(glob.glob(f"{out}/{split}-*.tar"))


def _loader(dataset, **kw):
    return torch.utils.data.DataLoader(dataset, num_workers=2, **{"batch_size": None, **kw})


# -- the readers --------------------------------------------------------------------------------------------------
def test_the_default_layout_gives_every_split_enough_shards_for_two_workers(data):
    m = load(data)
    assert all(len(m.splits[n].shards) >= min(8, m.splits[n].samples) for n in SPLITS)
    assert m.settings["min_shards"] == 8 and len(m.splits["val"].shards) >= 2


def test_webdataset_in_a_dataloader_with_two_workers(data):
    wds = pytest.importorskip("webdataset")
    multi = load(data).multilabel
    for split in SPLITS:
        ds = wds.WebDataset(_shards(data, split), shardshuffle=False).decode("pil")
        ds = ds.to_tuple("__key__", "jpg", "json" if multi else "cls")
        rows = list(_loader(ds))
        assert all(isinstance(image, Image.Image) for _, image, _ in rows)
        _check([(k, _label(label, multi) if multi else label) for k, _, label in rows], reference(data, split))


def _wids_sample(multi: bool, sample: dict):
    assert isinstance(sample[".jpg"], Image.Image)
    return sample["__key__"], _label(sample[".json"], multi) if multi else sample[".cls"]


def test_wids_reads_each_split_from_its_descriptor(data, tmp_path):
    wids = pytest.importorskip("wids")
    from wids.wids_decode import default_decoder

    multi = load(data).multilabel
    for split in SPLITS:
        decode = [functools.partial(default_decoder, format="PIL"), functools.partial(_wids_sample, multi)]
        ds = wids.ShardListDataset(str(data / f"wids-{split}.json"), cache_dir=str(tmp_path / "wids"),
                                   transformations=decode)
        assert len(ds) == load(data).splits[split].samples
        _check(list(_loader(ds)), reference(data, split))


def _pixels(im) -> torch.Tensor:
    return torch.tensor(_digest(im))


def test_timm_create_dataset_finds_each_split_and_its_labels(data):
    timm_data = pytest.importorskip("timm.data")
    multi = load(data).multilabel
    # the README's calls: multi-label data takes its multi-hot target from the .json member
    labels = dict(target_key="labels", target_transform=functools.partial(torch.tensor, dtype=torch.float32)) \
        if multi else {}
    for split in SPLITS:
        ds = timm_data.create_dataset("wds/fastpipe", root=str(data), split=split, transform=_pixels, **labels)
        ref = reference(data, split)
        assert len(ds) == len(ref)
        by_pixels = {p: k for k, (_, _, p) in ref.items()}
        got = [(by_pixels[int(p)], tuple(int(v) for v in y) if multi else int(y))
               for x, t in _loader(ds, batch_size=4) for p, y in zip(x, t)]
        _check(got, ref)


def _hf_label(multi: bool, row: dict):
    return row["__key__"], _label(row["json"], multi)


def test_hugging_face_datasets_default_call_and_streaming_with_two_workers(data, tmp_path):
    datasets = pytest.importorskip("datasets")
    multi = load(data).multilabel
    files = {split: f"{data}/{split}-*.tar" for split in SPLITS}
    loaded = datasets.load_dataset("webdataset", data_files=files, cache_dir=str(tmp_path / "hf"))
    streamed = datasets.load_dataset("webdataset", data_files=files, streaming=True, cache_dir=str(tmp_path / "hf"))
    for split in SPLITS:
        ref = reference(data, split)
        rows = loaded[split].select_columns(["__key__", "json"])
        _check([_hf_label(multi, r) for r in rows], ref)
        stream = streamed[split].select_columns(["__key__", "json"])
        _check([_hf_label(multi, r) for r in _loader(stream)], ref)


def _dali_part(out: Path, split: str, shard_id: int, count: int) -> list[tuple[dict, object]]:
    """One of two DALI readers (two GPUs' worth) over a split, on the CPU: `count` samples' .json and label."""
    from nvidia.dali import fn, pipeline_def, types

    m = load(out)
    shards = m.splits[split].shards

    @pipeline_def(batch_size=1, num_threads=2, device_id=None)
    def pipe():
        jpg, meta, lbl = fn.readers.webdataset(
            paths=[str(out / s.path) for s in shards], index_paths=[str(out / s.index) for s in shards],
            ext=["jpg", "json", "lbl"], dtypes=[types.UINT8, types.UINT8, types.UINT8 if m.multilabel else types.INT32],
            num_shards=2, shard_id=shard_id, name="r")
        return fn.decoders.image(jpg, device="cpu"), meta, lbl

    p = pipe()
    p.build()
    got = []
    for _ in range(count):
        image, meta, lbl = (o.as_array()[0] for o in p.run())
        assert image.ndim == 3 and image.shape[2] == 3
        got.append((json.loads(meta.tobytes()), tuple(int(v) for v in lbl) if m.multilabel else int(lbl[0])))
    del p
    return got


@pytest.mark.dali
def test_dali_reads_with_fastpipes_indexes_on_the_cpu(data):
    for split in SPLITS:
        ref, n = reference(data, split), load(data).splits[split].samples
        by_source = {source: k for k, (_, source, _) in ref.items()}
        # DALI's reader i of 2 takes samples [n * i // 2, n * (i + 1) // 2) of the split
        parts = [_dali_part(data, split, i, n * (i + 1) // 2 - n * i // 2) for i in range(2)]
        _check([(by_source[meta["path"]], label) for part in parts for meta, label in part], ref)


@pytest.mark.slow
def test_ray_data_read_webdataset(data):
    ray_data = pytest.importorskip("ray.data")
    import ray

    multi = load(data).multilabel
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for split in SPLITS:
            rows = ray_data.read_webdataset(_shards(data, split)).select_columns(["__key__", "json"]).take_all()
            _check([(r["__key__"], _label(r["json"], multi)) for r in rows], reference(data, split))
    finally:
        ray.shutdown()


# -- what makes them work -------------------------------------------------------------------------------------------
def test_every_json_member_has_the_same_fields_and_types(multi):
    """Hugging Face types the .json columns from the first samples it reads: an empty label list there was a list
    of nulls, and the first real label then failed to load. The multi-hot `labels` is never empty."""
    m = load(multi)
    metas = []
    for split in SPLITS:
        first = m.splits[split].shards[0]
        with open(multi / first.path, "rb") as fh:
            metas += [json.loads(read_member(fh, p["json"])) for _, p in read_index(multi / first.index)]
    assert metas and all(not any(meta["labels"]) for meta in metas), "the fixture lost its empty first shards"
    types = {json.dumps({k: type(v).__name__ for k, v in meta.items()}) for meta in metas}
    assert types == {json.dumps({"classes": "str", "labels": "list", "orig_size": "list", "path": "str",
                                 "size": "list"})}
    assert all(len(meta["labels"]) == len(m.classes) for meta in metas)

"""The loader contract on every backend, the epoch rule, balance, bad data, determinism, DDP."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_folder

from fastpipe import make_loader
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.dataset.loading import load
from fastpipe.dataset.shardformat import read_index
from fastpipe.errors import ConfigError
from fastpipe.loaders.epoch import TrainOrder, batches_per_epoch, step_slice, val_batches, worker_batches
from fastpipe.loaders.shards import ShardError

REAL = ["torch", "nvjpeg", pytest.param("dali", marks=pytest.mark.dali)]
KW = dict(batch_size=8, image_size=48, device="cpu")
# The torch and nvjpeg backends' workers: processes, threads of the training process (loaders/threads.py), or those
# threads in one helper process
MODES = [pytest.param(False, id="processes"), pytest.param(True, id="threads"), pytest.param("helper", id="helper")]
REAL_MODES = [("torch", False), ("torch", True), ("torch", "helper"), ("nvjpeg", False), ("nvjpeg", True),
              pytest.param("dali", None, marks=pytest.mark.dali)]


def dominant(images: torch.Tensor, manifest) -> list[str]:
    """Class name from the dominant colour channel, undoing the normalisation."""
    mean = torch.tensor(manifest.mean).view(1, 3, 1, 1)
    std = torch.tensor(manifest.std).view(1, 3, 1, 1)
    rgb = (images.float() * std + mean).mean((2, 3)) if images.is_floating_point() else images.float().mean((2, 3))
    return [["red", "green", "blue"][i] for i in rgb.argmax(1).tolist()]


@pytest.mark.parametrize("backend,threads", REAL_MODES)
@pytest.mark.parametrize("split", ["train", "val"])
def test_contract_on_every_backend(converted, backend, threads, split):
    m = load(converted)
    loader = make_loader(converted, backend, split=split, num_workers=2, threads=threads, **KW)
    batches = list(loader)
    assert len(batches) == len(loader) == batches_per_epoch(split, m.split(split).samples, 8, 1)
    seen = 0
    for x, y in batches:
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 48, 48) and x.device.type == "cpu"
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert y.dtype == torch.int64 and len(y) == len(x)
        assert x.min() > -4 and x.max() < 4  # normalised with the data set's own statistics
        assert [m.classes[i] for i in y.tolist()] == dominant(x, m)  # labels belong to their images
        seen += len(y)
    assert loader.stats.batches == len(loader) and loader.stats.samples == seen
    if split == "train":
        assert all(len(y) == 8 for _, y in batches)  # drop_last: no tiny batch for BatchNorm
    else:
        assert seen == m.split("val").samples  # every val sample, once


@pytest.mark.parametrize("backend", REAL)
def test_uint8_output(converted, backend):
    x, _ = next(iter(make_loader(converted, backend, split="val", normalize=False, num_workers=0, **KW)))
    assert x.dtype == torch.uint8 and x.is_contiguous(memory_format=torch.channels_last) and x.max() > 100


@pytest.mark.parametrize("normalize,expected", [
    ("dataset", None), (True, None), ("imagenet", ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))),
    (((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)), ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))),
    ("0.5,0.4,0.3:0.2,0.25,0.3", ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)))])
def test_images_are_normalised_with_the_statistics_asked_for(converted, normalize, expected):
    """The data set's own (the default), ImageNet's (for weights trained on it) or the user's, on the same images;
    the loader's description (a run's config.json) says which numbers it used."""
    mean, std = expected or (load(converted).mean, load(converted).std)
    raw, _ = next(iter(make_loader(converted, split="val", normalize=False, num_workers=0, **KW)))
    loader = make_loader(converted, split="val", normalize=normalize, num_workers=0, **KW)
    x, _ = next(iter(loader))
    want = (raw.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.allclose(x, want, atol=1e-4)
    assert loader.describe()["normalization"] == {"mean": tuple(mean), "std": tuple(std)}


@pytest.mark.parametrize("bad,says", [("imgnet", "use dataset .*, imagenet"), ("0.5,0.5:0.2,0.2", "three"),
                                      ("123.7,116.3,103.5:58.4,57.1,57.4", "0-1 scale.*imagenet"),
                                      (((0.5,) * 3, (0.0,) * 3), r"stds within 1/255"),
                                      ("0.5,0.5,0.5:1e-300,1e-300,1e-300", r"1e-300.*stds within 1/255 .*\.\.1")])
def test_a_normalisation_that_is_not_one_is_refused_with_the_forms(converted, bad, says):
    with pytest.raises(ConfigError, match=says):
        make_loader(converted, split="val", normalize=bad, num_workers=0, **KW)


def test_a_numpy_mean_and_std_normalise_as_a_tuple_does(converted):
    pair = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    want, _ = next(iter(make_loader(converted, split="val", normalize=pair, num_workers=0, **KW)))
    for given in (np.array(pair), torch.tensor(pair, dtype=torch.float64)):
        x, _ = next(iter(make_loader(converted, split="val", normalize=given, num_workers=0, **KW)))
        assert torch.equal(x, want)


def test_a_channel_that_never_varies_is_normalised_with_the_std_recorded(converted, tmp_path):
    """A data set whose red channel is one value (std 0): the loader divides by the floor, one grey level, and its
    description (what a run records) says that number, not the 0 it would divide by."""
    from dataclasses import replace

    from fastpipe.dataset.manifest import Stats, save
    from fastpipe.options import STD_FLOOR

    out = tmp_path / "flat"
    shutil.copytree(converted, out)
    m = load(out)
    s = m.stats
    flat = Stats(s.pixels, s.sum, (s.sum[0] ** 2 / s.pixels, *s.sumsq[1:]))  # red: sumsq/n == mean**2
    save(replace(m, stats=flat), out)
    assert load(out).std[0] == 0
    raw, _ = next(iter(make_loader(out, split="val", normalize=False, num_workers=0, **KW)))
    loader = make_loader(out, split="val", num_workers=0, **KW)
    x, _ = next(iter(loader))
    used = loader.describe()["normalization"]
    assert used["std"] == (STD_FLOOR, *flat.std[1:])
    mean, std = (torch.tensor(used[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    assert torch.allclose(x, (raw.float() / 255 - mean) / std, atol=1e-4)


def test_backends_agree_on_val_images(converted):
    out = {}
    backends = ["torch", "nvjpeg"] + (["dali"] if _has_dali() else [])
    for b in backends:
        out[b] = torch.cat([x for x, _ in make_loader(converted, b, split="val", num_workers=0, **KW)])
    for b in backends[1:]:
        assert out[b].shape == out["torch"].shape
        diff = (out[b] - out["torch"]).abs().mean().item()
        assert diff < 0.08, f"{b} differs from torch by {diff:.3f} (normalised units)"


def _has_dali():
    from conftest import has_dali

    return has_dali()


def test_synthetic_has_the_real_loaders_shape_and_length(converted):
    real = make_loader(converted, "torch", num_workers=0, **KW)
    syn = make_loader(converted, "synthetic", **KW)
    assert len(syn) == len(real)
    batches = list(syn)
    assert len(batches) == len(real) and batches[0][0].shape == (8, 3, 48, 48)
    assert batches[0][0].is_contiguous(memory_format=torch.channels_last)


def test_unknown_backend_and_setting_are_refused(converted):
    with pytest.raises(ValueError, match="torch, dali, nvjpeg, synthetic"):
        make_loader(converted, "ffcv")
    with pytest.raises(ValueError, match="batch_sise"):
        make_loader(converted, "torch", batch_sise=3)


def test_missing_dali_says_how_to_install(converted, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # what Python does when it isn't installed
    with pytest.raises(ImportError, match=r"pip install 'fastpipe\[dali\]'"):
        make_loader(converted, "dali", **KW)


# -- the epoch rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("counts,block", [([7, 7, 3], 4), ([100], 1000), ([1] * 7, 2), ([13, 2, 9, 20], 10)])
def test_the_epoch_sequence_is_a_permutation_fixed_by_seed_and_epoch(counts, block):
    order = TrainOrder(counts, seed=3, block=block)
    a = order.sequence(5)
    assert sorted(a.tolist()) == list(range(sum(counts)))
    assert np.array_equal(a, TrainOrder(counts, seed=3, block=block).sequence(5))
    assert not np.array_equal(a, order.sequence(6)) or sum(counts) < 3


@pytest.mark.parametrize("total,world,workers,batch", [(17, 2, 2, 2), (100, 4, 3, 5), (7, 3, 1, 2), (44, 3, 4, 3)])
def test_train_steps_are_exact_and_disjoint(total, world, workers, batch):
    """Every (rank, worker) slot reads exactly its batches; no position is read twice; the remainder is short."""
    per_rank = batches_per_epoch("train", total, batch, world)
    taken = []
    for r, w in itertools.product(range(world), range(workers)):
        mine = [step_slice(0, t, r, world, batch) for t in range(w, per_rank, workers)]
        assert len(mine) == worker_batches(per_rank, w, workers)
        taken += [p for sl in mine for p in range(sl.start, sl.stop)]
    assert len(taken) == len(set(taken)) == world * per_rank * batch and max(taken) < total
    assert total - len(taken) < world * batch


@pytest.mark.parametrize("total,world,batch", [(7, 2, 3), (10, 4, 3), (9, 2, 4), (5, 3, 1), (64, 1, 64)])
def test_val_batches_cover_everything_once_with_equal_counts(total, world, batch):
    counts = [total // 3, total - 2 * (total // 3), total // 3]
    seen, lengths = [], set()
    for r in range(world):
        bs = val_batches(counts, r, world, batch)
        lengths.add(len(bs))
        for pieces in bs:
            assert sum(p.count for p in pieces) <= batch
            seen += [(p.shard, p.start + i) for p in pieces for i in range(p.count)]
    assert len(lengths) == 1 and len(seen) == len(set(seen)) == total


@pytest.mark.parametrize("threads", MODES)
def test_simulated_ranks_yield_equal_counts_and_cover_val_once(converted, threads):
    m = load(converted)
    single = sorted(img.sum().item() for x, _ in make_loader(converted, split="val", num_workers=0, **KW)
                    for img in x)
    parts, counts = [], set()
    for rank in range(3):
        loader = make_loader(converted, split="val", rank=rank, world_size=3, num_workers=2, threads=threads, **KW)
        got = [x for x, _ in loader]
        counts.add(len(got))
        parts += [img.sum().item() for x in got for img in x]
        train = make_loader(converted, split="train", rank=rank, world_size=3, num_workers=2, threads=threads, **KW)
        assert len(list(train)) == len(train) == m.split("train").samples // 24
    assert len(counts) == 1
    assert sorted(parts) == pytest.approx(single)


@pytest.mark.parametrize("threads", MODES)
def test_set_epoch_is_deterministic(converted, threads):
    def epoch(e, workers=2):
        loader = make_loader(converted, num_workers=workers, threads=threads, seed=5, **KW)
        loader.set_epoch(e)
        return torch.cat([x for x, _ in loader]), torch.cat([y for _, y in loader])

    a, b, c = epoch(1), epoch(1), epoch(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("threads", MODES)
def test_persistent_workers_see_set_epoch(converted, threads):
    loader = make_loader(converted, num_workers=2, threads=threads, seed=1, **KW)
    first = torch.cat([y for _, y in loader])
    loader.set_epoch(1)
    second = torch.cat([y for _, y in loader])
    loader.set_epoch(0)
    again = torch.cat([y for _, y in loader])
    assert torch.equal(first, again) and not torch.equal(first, second)


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_balance_gives_near_uniform_classes(tmp_path, backend):
    src = make_folder(tmp_path / "src", {"red": 60, "green": 12, "blue": 4}, size=(64, 48))
    out = tmp_path / "out"
    shard(ShardConfig(src, out, short_side=48, val_fraction=0, workers=1, max_shard_size=64 * 1024))
    loader = make_loader(out, backend, balance=True, num_workers=2, batch_size=8, image_size=32, device="cpu")
    counts = torch.zeros(3)
    for e in range(6):
        loader.set_epoch(e)
        for _, y in loader:
            counts += torch.bincount(y, minlength=3)
    share = counts / counts.sum()
    assert share.min() > 0.22 and share.max() < 0.45, share  # unbalanced: 0.79 / 0.16 / 0.05


def _corrupt_one_sample(out: Path, split: str = "train") -> str:
    """Overwrite one stored JPEG after its start marker with garbage, keeping the shard's size."""
    m = load(out)
    s = m.splits[split].shards[0]
    key, parts = read_index(out / s.index)[1]
    off, size = parts["jpg"]
    data = bytearray((out / s.path).read_bytes())
    data[off + 2 : off + size] = np.random.default_rng(0).bytes(size - 2)
    (out / s.path).write_bytes(bytes(data))
    return key


@pytest.fixture
def corrupted(converted, tmp_path) -> tuple[Path, str]:
    out = tmp_path / "bad"
    shutil.copytree(converted, out)
    return out, _corrupt_one_sample(out)


WORKERS = [pytest.param(0, None, id="in-process"), pytest.param(2, False, id="processes"),
           pytest.param(2, True, id="threads"), pytest.param(2, "helper", id="helper")]


@pytest.mark.parametrize("backend", ["torch", "nvjpeg"])
@pytest.mark.parametrize("workers,threads", WORKERS)
def test_corrupt_sample_is_skipped_and_counted(corrupted, backend, workers, threads):
    out, key = corrupted
    loader = make_loader(out, backend, num_workers=workers, threads=threads, **{**KW, "batch_size": 7})
    loader.set_epoch(0)
    with pytest.warns(UserWarning, match=f"skipping sample {key} in shard train-000000.tar"):
        batches = [b for e in range(3) for b in _epoch(loader, e)]
    # train: the bad sample's place is filled with a copy of a good one, so every batch keeps its shape
    assert all(len(y) == 7 for _, y in batches) and loader.stats.skipped <= 1
    assert sum(_epoch_skips(loader, e) for e in range(3)) >= 1


def _epoch(loader, e):
    loader.set_epoch(e)
    return list(loader)


def _epoch_skips(loader, e):
    import warnings

    loader.set_epoch(e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        list(loader)
    return loader.stats.skipped


@pytest.mark.parametrize("workers,threads", WORKERS)
def test_corrupt_sample_raises_with_its_key_not_a_worker_traceback(corrupted, workers, threads):
    from fastpipe.errors import DataError

    out, key = corrupted
    loader = make_loader(out, "torch", num_workers=workers, threads=threads, on_error="raise",
                         **{**KW, "batch_size": 1})
    with pytest.raises(DataError, match=rf"sample {key} in shard train-000000.tar") as e:
        list(loader)
    assert "Traceback" not in str(e.value)


@pytest.mark.parametrize("backend", ["torch", "nvjpeg"])
@pytest.mark.parametrize("threads", MODES)
def test_a_val_sample_that_fails_is_left_out_not_counted_twice(converted, tmp_path, backend, threads):
    out = tmp_path / "bad"
    shutil.copytree(converted, out)
    key = _corrupt_one_sample(out, "val")
    loader = make_loader(out, backend, split="val", num_workers=2, threads=threads, **KW)
    with pytest.warns(UserWarning, match=f"skipping sample {key}"):
        seen = sum(len(y) for _, y in loader)
    assert seen == load(out).splits["val"].samples - 1 and loader.stats.skipped == 1


@pytest.mark.parametrize("workers,threads", WORKERS)
def test_a_stored_label_outside_the_classes_is_named(converted, tmp_path, workers, threads):
    """A `.lbl` record altered in place (same size): the batch-wise label read names the shard and the sample."""
    from fastpipe.errors import DataError

    out = tmp_path / "badlabel"
    shutil.copytree(converted, out)
    s = load(out).splits["train"].shards[0]
    key, parts = read_index(out / s.index)[2]
    off, size = parts["lbl"]
    data = bytearray((out / s.path).read_bytes())
    data[off : off + size] = np.int32(99).tobytes()
    (out / s.path).write_bytes(bytes(data))
    loader = make_loader(out, "torch", num_workers=workers, threads=threads, **KW)
    with pytest.raises(DataError, match=rf"{s.path}, sample '{key}': label 99 is outside the"):
        list(loader)


def test_missing_or_truncated_shard_is_named(converted, tmp_path):
    out = tmp_path / "broken"
    shutil.copytree(converted, out)
    victim = out / load(out).splits["train"].shards[1].path
    victim.write_bytes(victim.read_bytes()[:5000])
    with pytest.raises(ShardError, match=victim.name):
        make_loader(out, "torch", num_workers=0, **KW)
    victim.unlink()
    with pytest.raises(ShardError, match=f"{victim.name} is missing"):
        make_loader(out, "torch", num_workers=0, **KW)


def test_a_shard_cut_short_after_the_loader_opened_it_is_named_whoever_maps_it_first(converted, tmp_path):
    """Its bounds are checked once, where it is mapped, by whatever maps it first (a batch's read, or naming one
    sample for a message): a later batch's slices are never short, never a "bad JPEG" silently replaced."""
    from fastpipe.loaders.shards import ShardSet

    out = tmp_path / "cut"
    shutil.copytree(converted, out)
    for first in ("sample", "read"):
        shards = ShardSet(load(out), "train")
        victim = shards.paths[1]
        whole = victim.read_bytes()
        victim.write_bytes(whole[: len(whole) // 2])
        i = int(shards.starts[1])  # the shard's first sample: its own bytes are all there
        with pytest.raises(ShardError, match=f"{victim.name} ends before byte"):
            shards.sample(i) if first == "sample" else shards.read([i])
        with pytest.raises(ShardError, match=victim.name):
            shards.read([i])
        victim.write_bytes(whole)


def test_worker_count_is_measured_once_and_cached(converted, tmp_path, monkeypatch):
    from fastpipe.loaders.workers import _candidates

    monkeypatch.setenv("FASTPIPE_CACHE", str(tmp_path))
    plain = make_loader(converted, num_workers=None, **KW)  # the default: no probe, nothing written
    assert plain.num_workers >= 1 and not (tmp_path / "workers.json").exists()
    loader = make_loader(converted, num_workers="probe", **KW)
    assert loader.num_workers in _candidates()
    cached = next(iter(json.loads((tmp_path / "workers.json").read_text()).values()))
    assert {k.split()[1] for k in cached["img_per_s"]} == {"threads", "processes"}  # both modes measured
    assert (loader.num_workers, loader.in_threads) == (cached["workers"], cached["threads"])
    again = make_loader(converted, num_workers="probe", **KW)
    assert (again.num_workers, again.in_threads) == (loader.num_workers, loader.in_threads)


def test_two_ranks_for_real_with_torchrun(tmp_path):
    """Uneven shards (5) for 2 ranks x 2 workers: both ranks finish with the same count, val covered once."""
    src = make_folder(tmp_path / "src", {"red": 23, "green": 17, "blue": 9}, size=(64, 48))
    out = tmp_path / "out"
    shard(ShardConfig(src, out, short_side=48, val_fraction=0.2, workers=1, max_shard_size=96 * 1024))
    assert len(load(out).splits["train"].shards) % 2 == 1 or len(load(out).splits["train"].shards) > 2
    torchrun = Path(sys.executable).with_name("torchrun")
    script = Path(__file__).with_name("ddp_loader_check.py")
    r = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29517", str(script), str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DDP-OK" in r.stdout


def test_an_epoch_never_repeats_a_sample_even_with_a_large_shuffle_buffer(converted):
    """The shuffle block (5000) is larger than the data set: samples must still come once each."""
    from fastpipe.loaders.config import LoaderConfig
    from fastpipe.loaders.prepare import Raw
    from fastpipe.loaders.shards import ShardSet
    from fastpipe.loaders.stream import SampleStream, train_order

    m = load(converted)
    cfg = LoaderConfig(batch_size=8, image_size=32, shuffle_buffer=5000).resolved()
    shards = ShardSet(m, "train")
    stream = SampleStream(shards, cfg, Raw(cfg, m.num_classes), train_order(shards, cfg, m))
    seen = [bytes(img) for batch in stream for img in batch.data]
    assert len(seen) == len(set(seen)) == (m.splits["train"].samples // 8) * 8


# -- on a GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "nvjpeg", pytest.param("dali", marks=pytest.mark.dali)])
def test_gpu_backends_match_the_cpu_loader(converted, backend):
    """Side-stream prefetch (torch), nvJPEG decode (nvjpeg), mixed decode (dali): same contract on CUDA, and
    the same val images as the CPU path within decoder tolerance."""
    m = load(converted)
    gpu = make_loader(converted, backend, split="val", num_workers=1, **{**KW, "device": "cuda"})
    cpu = make_loader(converted, "torch", split="val", num_workers=1, **KW)
    xs, ys = zip(*gpu)
    x = torch.cat(xs)
    assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last) and x.dtype == torch.float32
    assert [m.classes[i] for i in torch.cat(ys).tolist()] == dominant(x.cpu(), m)
    ref = torch.cat([x for x, _ in cpu])
    assert (x.cpu() - ref).abs().mean() < 0.08
    train = make_loader(converted, backend, num_workers=2, **{**KW, "device": "cuda"})
    assert sum(1 for _ in train) == len(train)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", MODES)
def test_side_stream_prefetch_overlaps_without_corruption(converted, threads):
    """Consume batches slowly on the compute stream while the next one is copied: values must stay intact."""
    loader = make_loader(converted, "torch", split="val", num_workers=1, threads=threads, **{**KW, "device": "cuda"})
    sums = []
    for x, _ in loader:
        torch.cuda._sleep(2_000_000)  # keep the compute stream busy while the side stream copies ahead
        sums.append(x.double().sum().item())
    again = [x.double().sum().item() for x, _ in loader]
    assert sums == pytest.approx(again)


@pytest.mark.parametrize("threads", MODES)
def test_recycled_worker_buffers_never_overwrite_a_batch_in_use(converted, threads):
    """Both recycle worker buffers (normalised output once copied, uint8 once dropped): holding a whole epoch of
    both, the normalised batches must equal the normalisation of the uint8 ones, batch for batch."""
    kw = {**KW, "batch_size": 1, "num_workers": 2, "prefetch_factor": 2, "seed": 3, "threads": threads}
    floats = make_loader(converted, "torch", **kw)
    uint8 = make_loader(converted, "torch", normalize=False, **kw)
    assert uint8.hands_out_buffer and not floats.hands_out_buffer
    for epoch in range(2):  # the second epoch reuses the first one's buffers
        floats.set_epoch(epoch)
        uint8.set_epoch(epoch)
        _check_same(list(floats), list(uint8), floats)
        assert len(floats) > 2 * (2 + 2)  # more batches than the pools hold


@pytest.mark.gpu
def test_pinned_thread_buffers_are_reused_only_once_their_copy_has_run(converted, monkeypatch):
    """Worker threads decode into pinned buffers copied to the device without blocking. Each copy is made to wait
    on its stream behind a GPU sleep: a buffer handed back to its thread when the copy was queued, not when it ran,
    would be rewritten before it is read. uint8 on the GPU must equal the CPU's, batch for batch."""
    from fastpipe.loaders.base import DeviceStep

    real = DeviceStep.images

    def late(self, nhwc):
        torch.cuda._sleep(20_000_000)  # on the side stream the copy is queued on
        return real(self, nhwc)

    kw = {**KW, "batch_size": 1, "num_workers": 2, "prefetch_factor": 1, "seed": 2, "normalize": False,
          "threads": True}
    cpu = [x for x, _ in make_loader(converted, **kw)]
    monkeypatch.setattr(DeviceStep, "images", late)
    gpu = make_loader(converted, **{**kw, "device": "cuda"})
    assert gpu.buffers.pin and len(gpu) > 2 * (1 + 2)  # more batches than the pools hold
    held = [x for x, _ in gpu]
    assert len(held) == len(cpu) and all(torch.equal(a.cpu(), b) for a, b in zip(held, cpu))


def _check_same(held_f, held_u, floats):
    assert len(held_f) == len(held_u)
    for (xf, yf), (xu, yu) in zip(held_f, held_u):
        assert torch.equal(yf, yu)
        assert torch.allclose(xf, floats.step.finish(xu.clone()), atol=1e-5)


@pytest.mark.dali
def test_workers_are_not_forked_from_a_process_holding_dali(converted):
    """A forked copy of a DALI pipeline hangs in its destructor; with DALI loaded, workers come from forkserver."""
    dali = make_loader(converted, "dali", split="val", **KW)
    assert sum(1 for _ in dali) == len(dali)  # a live pipeline in this process
    torch_loader = make_loader(converted, "torch", split="val", num_workers=2, threads=False, **KW)
    assert torch_loader.dataloader.multiprocessing_context.get_start_method() == "forkserver"
    assert sum(1 for _ in torch_loader) == len(torch_loader)


@pytest.mark.parametrize("threads", MODES)
def test_a_uint8_batch_kept_as_numpy_stays_intact(converted, threads):
    """A notebook's habit: each batch kept as a numpy array (or a slice of one), the tensor dropped. The buffer
    under it is not handed to a later batch while the array lives."""
    kw = {**KW, "batch_size": 1, "num_workers": 2, "prefetch_factor": 2, "seed": 4, "normalize": False,
          "threads": threads}
    loader = make_loader(converted, "torch", **kw)
    held = [(x.numpy()[0], x.numpy().copy()) for x, _ in loader]
    for _ in range(2):  # more epochs, written into buffers while the arrays are held
        for _ in loader:
            pass
    for kept, copy in held:
        assert np.array_equal(kept, copy[0])


@pytest.mark.parametrize("threads", MODES)
def test_uint8_batches_reuse_buffers_yet_stay_intact_while_held(converted, monkeypatch, threads):
    """uint8 on the CPU hands out the workers' buffers themselves. Batches kept across a whole second epoch are not
    overwritten; batches dropped at once go back to the pool and are written again."""
    kw = {**KW, "batch_size": 1, "num_workers": 2, "prefetch_factor": 2, "seed": 4, "normalize": False,
          "threads": threads}
    from fastpipe.loaders.batch import BufferPool

    lent, lend = [], BufferPool.lend
    monkeypatch.setattr(BufferPool, "lend", lambda pool, images, slot: (lent.append(slot), lend(pool, images, slot))[1])
    loader = make_loader(converted, "torch", **kw)
    held = [(x[0], y) for x, y in loader]  # a view of each batch, as a user might keep a slice
    copies = [(x.clone(), y) for x, y in held]
    pooled = [s for s in lent if s >= 0]  # -1: a fresh buffer, made when every pooled one is held
    assert len(set(pooled)) == len(pooled) == 2 * (2 + 2) < len(lent)  # all held: no slot was lent twice
    for _ in loader:  # the same epoch again while the first is held: written into other buffers
        pass
    for (x, y), (xc, yc) in zip(held, copies):
        assert torch.equal(x, xc) and torch.equal(y, yc)
    del held, x
    lent.clear()
    for _ in loader:  # dropped as they come: the pooled slots are reused
        pass
    pooled = [s for s in lent if s >= 0]
    # the helper process learns that a batch was dropped a message later: it reuses most slots, not nearly all
    assert len(pooled) >= (len(lent) - 2 if threads != "helper" else len(lent) // 2)
    assert len(set(pooled)) <= 2 * (2 + 2) < len(pooled)
    with pytest.warns(DeprecationWarning, match="reuse_output"):
        make_loader(converted, "torch", reuse_output=True, **kw)


class _HandOverFails:
    """A DataLoader iterator as the main process sees it when the worker that made the next batch was killed: the
    batch's hand-over fails (EOFError from the dead worker's resource sharer) before PyTorch can see the process end,
    or the pin-memory thread that received it ended of that error."""

    def __init__(self, workers, batches=(), error=EOFError):
        self._workers, self.batches, self.error = workers, list(batches), error

    def __next__(self):
        if self.batches:
            return self.batches.pop(0)
        raise self.error


def test_a_killed_worker_is_named_however_its_death_shows_first():
    import multiprocessing as mp

    from fastpipe.loaders.processes import deaths_named as _deaths_named

    ctx = mp.get_context("fork")
    gone, stop = ctx.Process(target=lambda: None), ctx.Event()
    alive = ctx.Process(target=stop.wait, args=(60,))
    gone.start(), alive.start()
    try:
        gone.join(60)
        it = _deaths_named(_HandOverFails([alive, gone], ["b0", "b1"]))
        assert [next(it), next(it)] == ["b0", "b1"]
        with pytest.raises(RuntimeError, match=rf"^DataLoader worker \(pid\(s\) {gone.pid}\) exited unexpectedly$"):
            next(it)
        pin_thread_ended = RuntimeError("Pin memory thread exited unexpectedly")
        pinned = _deaths_named(_HandOverFails([alive, gone], error=pin_thread_ended))
        with pytest.raises(RuntimeError, match=rf"^DataLoader worker \(pid\(s\) {gone.pid}\) exited unexpectedly$"):
            next(pinned)
        with pytest.raises(EOFError):  # every worker alive: the error is not a death, and stays what it was
            next(_deaths_named(_HandOverFails([alive]), bound_s=0.2))
        with pytest.raises(RuntimeError, match=r"^a bug$"):  # another error: passed on at once
            next(_deaths_named(_HandOverFails([alive, gone], error=RuntimeError("a bug"))))
    finally:
        stop.set()
        alive.join(60)


# -- shared memory and DALI ------------------------------------------------------------------------------
def test_worker_batches_are_sized_to_the_shared_memory():
    from fastpipe.loaders.workers import fit_shared_memory

    mb = 2**20
    assert fit_shared_memory(2, 10 * mb, 4, 10_000 * mb) == (2, 4, "")  # plenty: as asked
    w, p, note = fit_shared_memory(2, 10 * mb, 4, 64 * mb)  # Docker's default /dev/shm
    assert (w, p) == (1, 2) and "--shm-size=" in note and "--threads on" in note  # or threads: no shared memory
    w, p, note = fit_shared_memory(2, 10 * mb, 4, 20 * mb)
    assert w == 0 and "in the training process" in note
    assert fit_shared_memory(0, 10 * mb, 4, 1) == (0, 4, "")


SHM_SCRIPT = """
import warnings, sys
from fastpipe import make_loader
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loader = make_loader(sys.argv[1], "torch", batch_size=32, image_size=224, num_workers=2, threads=False,
                         device="cpu")
n = 0
for epoch in range(2):
    loader.set_epoch(epoch)
    n += sum(len(y) for _, y in loader)
print("SAMPLES", n, loader.num_workers, loader.prefetch)
print("WARN", " | ".join(str(w.message) for w in caught))
"""


def test_a_small_dev_shm_slows_the_loader_down_instead_of_failing_in_a_worker(tmp_path):
    """A real 64 MB /dev/shm (Docker's default) in a private mount namespace: batch 32 at 224 px, 2 workers."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m (root) to mount a small /dev/shm")
    src = make_folder(tmp_path / "src", {"red": 110, "green": 110, "blue": 100}, size=(240, 180))
    out = tmp_path / "out"
    shard(ShardConfig(src, out, short_side=180, val_fraction=0, workers=0, max_shard_size=1024**2))
    (tmp_path / "run.py").write_text(SHM_SCRIPT)
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64m tmpfs /dev/shm && "
                        f"{sys.executable} {tmp_path / 'run.py'} {out}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SAMPLES 640" in r.stdout and "--shm-size=" in r.stdout, r.stdout


@pytest.mark.dali
def test_dali_names_an_undecodable_sample_and_the_repair_makes_it_read(corrupted):
    from fastpipe.convert.inspect import inspect
    from fastpipe.errors import DataError

    out, key = corrupted
    loader = make_loader(out, "dali", **{**KW, "batch_size": 1})
    with pytest.raises(DataError, match=rf"sample {key} is undecodable.*--verify --repair"):
        list(loader)
    report = inspect(out, verify=True, repair=True)
    assert report.ok and report.repaired and (out / "repaired.jsonl").exists()
    m = load(out)
    assert m.splits["train"].samples == load(out).splits["train"].shards[0].samples + sum(
        s.samples for s in m.splits["train"].shards[1:])
    repaired = make_loader(out, "dali", **{**KW, "batch_size": 1})
    assert sum(len(y) for _, y in repaired) == len(repaired)  # the whole epoch, no error
    torch_loader = make_loader(out, "torch", num_workers=0, **{**KW, "batch_size": 1})
    assert len(list(torch_loader)) == len(torch_loader) and torch_loader.stats.skipped == 0
    assert inspect(out, verify=True).ok


def test_repair_keeps_the_counts_consistent(corrupted, converted):
    from fastpipe.convert.inspect import inspect

    out, _key = corrupted
    before = load(out)
    assert not inspect(out, verify=True).ok
    inspect(out, verify=True, repair=True)
    after = load(out)
    assert after.splits["train"].samples == before.splits["train"].samples - 1
    assert sum(after.splits["train"].class_counts) == after.splits["train"].samples
    assert after.settings["repaired"] == 1 and (out / "dataset.json").exists()


# -- resumable state ---------------------------------------------------------------------------------------
def _keys(loader, stop=None):
    out = []
    for i, (_x, _y, k) in enumerate(loader):
        out += [str(s) for s in k]
        if stop is not None and i + 1 == stop:
            break
    return out


@pytest.mark.parametrize("threads", MODES)
def test_state_dict_resumes_exactly_the_rest_of_the_epoch(converted, threads):
    kw = {**KW, "batch_size": 4, "seed": 1, "with_keys": True, "threads": threads}
    whole = make_loader(converted, "torch", num_workers=2, **kw)
    whole.set_epoch(3)
    everything = _keys(whole)
    part = make_loader(converted, "torch", num_workers=2, **kw)
    part.set_epoch(3)
    first = _keys(part, stop=5)
    state = json.loads(json.dumps(part.state_dict()))  # JSON-able
    assert state["epoch"] == 3 and state["position"] == 20
    rest_loader = make_loader(converted, "torch", num_workers=3, **kw)  # another worker count
    rest_loader.load_state_dict(state)
    assert rest_loader.batches_left == len(whole) - 5
    rest = _keys(rest_loader)
    assert first + rest == everything  # same order, none twice, none missing
    assert rest_loader.state_dict()["epoch"] == 4 and rest_loader.state_dict()["position"] == 0


def test_keys_name_the_source_file(converted):
    loader = make_loader(converted, "torch", split="val", num_workers=0, with_keys=True, **KW)
    _x, y, keys = next(iter(loader))
    assert len(keys) == len(y)
    k = keys[0]
    assert k.shard.startswith("val-") and k.source.endswith(".jpg") and str(k).startswith(f"{k.shard}/{k.key}")
    assert k.source.split("/")[0] == load(converted).classes[int(y[0])]  # the source's class folder


def test_a_state_from_other_data_or_settings_is_refused(converted, folder, tmp_path):
    from fastpipe.errors import ConfigError

    other = tmp_path / "other"
    shard(ShardConfig(folder, other, short_side=48, workers=0))
    state = make_loader(other, "torch", num_workers=0, **KW).state_dict()
    with pytest.raises(ConfigError, match=r"another data set or settings .*data"):
        make_loader(converted, "torch", num_workers=0, **KW).load_state_dict(state)
    mine = make_loader(converted, "torch", num_workers=0, **KW).state_dict()
    with pytest.raises(ConfigError, match="seed: the state has 0, this loader 5"):
        make_loader(converted, "torch", num_workers=0, seed=5, **KW).load_state_dict(mine)


@pytest.mark.parametrize("field,value,says", [
    ("epoch", -1, "epoch -1: must be within"), ("epoch", 10**30, "epoch 10000000000000000000000000000"),
    ("epoch", 1.7, "epoch 1.7: must be an integer"), ("epoch", None, "epoch None: must be an integer"),
    ("epoch", float("nan"), "epoch nan"), ("position", [3], r"position \[3\]: must be an integer"),
    ("position", 10**6, "position 1000000: must be within 0.."), ("epoch", "missing", "no epoch"),
])
def test_a_state_that_is_not_one_is_refused_naming_the_field(converted, field, value, says):
    from fastpipe.errors import ConfigError

    loader = make_loader(converted, "torch", num_workers=0, **KW)
    state = loader.state_dict()
    if value == "missing":
        del state[field]
    else:
        state[field] = value
    with pytest.raises(ConfigError, match=f"loader state:? {says}"):
        loader.load_state_dict(state)


def test_elastic_resume_two_ranks_to_one_with_torchrun(tmp_path):
    """2 ranks x 2 workers read part of an epoch and stop; 1 rank x 3 workers resumes from the saved state: every
    sample of the epoch's consumed part comes once, none twice, and the rest is read."""
    src = make_folder(tmp_path / "src", {"red": 23, "green": 17, "blue": 9}, size=(64, 48))
    out = tmp_path / "out"
    shard(ShardConfig(src, out, short_side=48, val_fraction=0.1, workers=0, max_shard_size=96 * 1024))
    script, phase = Path(__file__).with_name("elastic_check.py"), tmp_path / "phase"
    phase.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29541", str(script), str(out),
                        str(phase), "stop", "2", "3"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r = subprocess.run([sys.executable, str(script), str(out), str(phase), "resume", "3"], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    first = [k for rank in (0, 1) for k in json.loads((phase / f"stop-{rank}.json").read_text())]
    rest = json.loads((phase / "resume-0.json").read_text())
    total = load(out).splits["train"].samples
    assert len(first) == 2 * 3 * 4 and len(set(first + rest)) == len(first + rest)  # none twice
    assert total - len(first + rest) < 4  # all but the last step's remainder


def test_a_batch_that_cannot_fit_memory_is_refused_before_anything_starts(converted):
    from fastpipe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"batch_size 4000 at image_size 4096 needs [\d,.]+ GB for one batch"):
        make_loader(converted, "torch", split="val", batch_size=4000, image_size=4096, device="cpu")


@pytest.mark.parametrize("setting,value,says", [
    ("num_workers", True, r"^num_workers=True: use a count >= 0 \(not True/False\), None .* or 'probe'"),
    ("num_workers", False, r"^num_workers=False: use a count >= 0"),
    ("rank", True, r"^rank True: must be an integer >= 0$"), ("world_size", True, "^world_size True: must be an "
                                                                                  "integer >= 1$"),
    ("batch_size", True, r"^batch_size True: must be an integer within 1\.\.65536$")])
def test_true_or_false_is_not_a_count(converted, setting, value, says):
    """num_workers=True was accepted (True is the int 1 in Python), then failed in torch.zeros with a TypeError."""
    from fastpipe.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        make_loader(converted, "torch", device="cpu", **{"num_workers": 0, setting: value})


@pytest.mark.parametrize("setting,says", [("min_scale", "min_scale nan: must be a finite number > 0"),
                                          ("val_crop", "val_crop 0: must be > 0"),
                                          ("prefetch_factor", "prefetch_factor 0: must be within 1..64"),
                                          ("seed", "seed -1: must be within 0..")])
def test_make_loaders_numbers_are_checked_like_the_cli_flags(converted, setting, says):
    from fastpipe.errors import ConfigError

    value = {"min_scale": float("nan"), "val_crop": 0, "prefetch_factor": 0, "seed": -1}[setting]
    with pytest.raises(ConfigError, match=says):
        make_loader(converted, "torch", device="cpu", num_workers=0, **{setting: value})

"""fastpipe against its peers — litdata, Mosaic streaming, webdataset — on the same photos and the same work, in one
run, interleaved: conversion, the per-sample machinery, and loading (with fastpipe's decode, and with each peer's
idiomatic simplejpeg + torchvision v2 decode; fastpipe's workers as threads and as processes).

    scripts/peers_env.sh          # once: .peers/, a venv with the peers beside fastpipe's own .venv
    .peers/bin/python benchmarks/bench_peers.py --rounds 9 --json docs/results/peers.json

The peers live in the benchmark's own environment, never in fastpipe's dependencies. Every figure is a median over
rounds with its range; each round runs every variant once, in a shuffled order, so drift in the machine's speed
hits all alike. Work per image: conversion = fastpipe's own per-image step (decode, EXIF, downsample to 320 px,
JPEG encode) for every tool; loading = random-resized-crop 224 + flip → uint8, batch 64, `--workers` workers.
The conversion part sets this process's allocator as fastpipe's conversion workers have it
(`util.reuse_freed_memory`, for the one-process bound); every tool's loader workers, forked after, inherit it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import multiprocessing
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from fastpipe.bench.timing import run_fresh, spread
from fastpipe.convert.images import Encoded, ImageSettings, process
from fastpipe.loaders import cpu_ops
from fastpipe.util import reuse_freed_memory

BATCH, SIZE = 64, 224
BOUND = "one-process decode bound"
# fastpipe's loader with its workers as threads of the training process (the default with the crop decoder or
# simplejpeg + OpenCV) and as processes; the first is the one the peers are compared with.
FASTPIPE = {"fastpipe, threads": True, "fastpipe, processes": False}
HEAD = "fastpipe, threads"
SETTINGS = ImageSettings()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", help="class folders of photos (default: demo photos, generated)")
    ap.add_argument("--photos", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="loading and machinery rounds")
    ap.add_argument("--convert-rounds", type=int, default=5)
    ap.add_argument("--only-conversion", action="store_true", help="skip the machinery and loading parts")
    ap.add_argument("--epochs", type=int, default=4, help="timed epochs per loader, after the first")
    ap.add_argument("--conversion-in-process", action="store_true",
                    help="convert in this process, whose allocator every tool's forked workers then inherit warm, "
                         "instead of a fresh process per conversion as a user's script runs it")
    ap.add_argument("--json", default="bench-results/peers.json")
    ap.add_argument("--convert-one", nargs=3, help=argparse.SUPPRESS)  # TOOL ITEMS_JSON OUT: one conversion
    return ap.parse_args(argv)


def interleaved(variants: dict, rounds: int, seed: int = 0) -> dict[str, list]:
    """Every variant once per round, in a shuffled order; each call returns a dict of figures."""
    out: dict[str, list] = {k: [] for k in variants}
    rng = random.Random(seed)
    for r in range(rounds):
        names = list(variants)
        rng.shuffle(names)
        for name in names:
            out[name].append(variants[name]())
        print(f"  round {r + 1}/{rounds}", flush=True)
    return out


# -- the photos and their conversion ---------------------------------------------------------------------------
def photos(args, base: Path) -> Path:
    if args.raw:
        return Path(args.raw)
    from fastpipe.convert.demo import DemoConfig, make_demo_data

    make_demo_data(DemoConfig(base / "raw", count=args.photos, width=1632, height=1224))
    return base / "raw"


def items_of(raw: Path, rejected: set[str]) -> list[tuple[str, int]]:
    classes = sorted(p.name for p in raw.iterdir() if p.is_dir())
    return [(str(f), c) for c, name in enumerate(classes) for f in sorted((raw / name).rglob("*"))
            if f.is_file() and not f.name.startswith(".") and str(f) not in rejected]


def convert_one(item: tuple[str, int]) -> dict:
    """The per-image work every tool gets: fastpipe's own (the peers would otherwise do less)."""
    e = process(Path(item[0]).read_bytes(), SETTINGS)
    assert isinstance(e, Encoded), item
    return {"image": e.jpeg, "label": item[1]}


def convert_fastpipe(raw: Path, out: Path, workers: int) -> None:
    from fastpipe.convert.driver import ShardConfig, shard

    # No val split: the loaders then read the same images as the peers, which convert everything.
    shard(ShardConfig(raw, out, workers=workers, max_shard_size=4 * 2**20, val_fraction=0))


def convert_litdata(items, out: Path, workers: int) -> None:
    from litdata import optimize

    optimize(fn=convert_one, inputs=items, output_dir=str(out), num_workers=workers, chunk_bytes="4MB",
             verbose=False, start_method="fork")


def convert_mosaic(items, out: Path, workers: int) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}, size_limit=4 * 2**20) as w, \
            multiprocessing.get_context("fork").Pool(workers) as pool:
        for sample in pool.imap(convert_one, items, chunksize=4):
            w.write(sample)


MODULES = {"fastpipe": "fastpipe.convert.driver", "litdata": "litdata", "mosaic": "streaming"}


TUNED = ", allocator as fastpipe's"  # the peer's call made after util.reuse_freed_memory() in its process


def convert_timed(name: str, raw: Path, items, out: Path, workers: int) -> dict:
    if name.endswith(TUNED):  # forked workers inherit the setting
        name = name.removesuffix(TUNED)
        reuse_freed_memory()
    tools = {"fastpipe": lambda: convert_fastpipe(raw, out, workers),
             "litdata": lambda: convert_litdata(items, out, workers),
             "mosaic": lambda: convert_mosaic(items, out, workers)}
    shutil.rmtree(out, ignore_errors=True)
    importlib.import_module(MODULES[name])  # imported before the clock starts, in a fresh process too
    cpu = _cpu()
    t = time.perf_counter()
    tools[name]()
    rate = len(items) / (time.perf_counter() - t)
    main, kids = (b - a for a, b in zip(cpu, _cpu()))
    return {"img_per_s": rate, "main_cpu_s": main, "workers_cpu_s": kids}


def convert_fresh(name: str, raw: Path, base: Path, workers: int) -> dict:
    """One conversion in a new Python process, timed inside the call: how a user's script meets it. glibc's
    allocator adapts to what a process has allocated and freed, and forked workers inherit that state, so
    conversions run in this (long-lived) process would all start from a state that no user's script has."""
    return run_fresh([__file__, "--convert-one", name, str(base / "items.json"), str(base / _folder(name)),
                      "--raw", str(raw), "--workers", str(workers)], f"{name} conversion")


def _folder(name: str) -> str:
    return "conv-" + name.removesuffix(TUNED) + ("-tuned" if name.endswith(TUNED) else "")


def conversion(raw: Path, items, base: Path, args) -> dict:
    (base / "items.json").write_text(json.dumps(items))

    def timed(name):
        if args.conversion_in_process:
            return convert_timed(name, raw, items, base / _folder(name), args.workers)
        return convert_fresh(name, raw, base, args.workers)

    # The bound: this process at its best, the allocator keeping freed memory (as fastpipe's workers do), so that
    # its rate does not depend on what this process happened to allocate before.
    reuse_freed_memory()

    def bound():  # one process, the same per-image work, no writing: measured in every round, as drift is large.
        # Every photo the tools convert, not a subset: the first photos by path are one or two classes, and one
        # class's photos can decode faster or slower than another's.
        t = time.perf_counter()
        for it in items:
            convert_one(it)
        return {"img_per_s": len(items) / (time.perf_counter() - t)}

    print("conversion (in-call, same per-image work):", flush=True)
    tools = ("fastpipe", "litdata", "mosaic") + (() if args.conversion_in_process else
                                                  ("litdata" + TUNED, "mosaic" + TUNED))
    runs = interleaved({**{k: (lambda k=k: timed(k)) for k in tools}, BOUND: bound}, args.convert_rounds)
    bounds = runs.pop(BOUND)
    res = {k: spread([r["img_per_s"] for r in v]) for k, v in runs.items()}
    # Where the CPU went: on cores that all convert, the calling process's CPU comes out of the workers' time
    cpu = {k: {part: spread([r[part] for r in v]) for part in ("main_cpu_s", "workers_cpu_s")}
           for k, v in runs.items()}
    # Ratios of the same round's runs, then their median (drift cancels within a round).
    fp = runs["fastpipe"]
    mode = "in process" if args.conversion_in_process else "a fresh process per conversion"
    return {"mode": mode, "rates": res, "cpu_s": cpu, "bound_per_process": spread([b["img_per_s"] for b in bounds]),
            "fastpipe_vs_bound": spread([a["img_per_s"] / (args.workers * b["img_per_s"])
                                          for a, b in zip(fp, bounds)]),
            **{f"fastpipe_vs_{k}": spread([a["img_per_s"] / b["img_per_s"] for a, b in zip(fp, runs[k])])
               for k in tools[1:]}}


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its ended children (the tools' worker processes, once joined)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def overheads(items) -> dict:
    """Shares of one image's conversion time: mean/std accumulation and hashing (source bytes for deduplication,
    the stored JPEG as part of its shard's checksum)."""
    import hashlib

    from PIL import Image

    from fastpipe.convert.images import channel_sums

    t_all = t_stats = t_hash = 0.0
    for path, _ in items[:40]:
        data = Path(path).read_bytes()
        t = time.perf_counter()
        e = process(data, SETTINGS)
        t_all += time.perf_counter() - t
        im = Image.open(__import__("io").BytesIO(e.jpeg)).convert("RGB")
        im.load()
        t = time.perf_counter()
        channel_sums(im)
        t_stats += time.perf_counter() - t
        t = time.perf_counter()
        hashlib.sha256(data).digest()
        hashlib.sha256(e.jpeg).digest()
        t_hash += time.perf_counter() - t
    return {"mean_std_share": t_stats / (t_all + t_hash), "hash_share": t_hash / (t_all + t_hash)}


# -- the per-sample machinery: bytes fetched, shuffled and handed over, one process, no decode -------------------
def machinery_fastpipe(fp: Path, epochs: int) -> float:
    from fastpipe.dataset.loading import load
    from fastpipe.loaders.config import LoaderConfig
    from fastpipe.loaders.rng import SampleRng
    from fastpipe.loaders.shards import ShardSet
    from fastpipe.loaders.stream import SampleStream, train_order

    m = load(fp)
    cfg = LoaderConfig(batch_size=BATCH, image_size=SIZE, device="cpu").resolved()
    shards = ShardSet(m, "train")

    def handed(raw, positions, epoch):  # what a worker has before decoding: bytes, label, crop generator
        rngs = SampleRng.batch((cfg.seed, epoch), positions)
        return SimpleNamespace(n=sum(len(im) > 0 and r.random() >= 0 for im, r in zip(raw.images, rngs)))

    stream = SampleStream(shards, cfg, handed, train_order(shards, cfg, m))
    n, t = 0, time.perf_counter()
    for e in range(epochs):
        stream.epoch[0] = e
        n += sum(b.n for b in stream)
    return (time.perf_counter() - t) / n * 1e6


def machinery_litdata(out: Path, epochs: int) -> float:
    from litdata import StreamingDataset

    ds = StreamingDataset(str(out), shuffle=True)
    n, t = 0, time.perf_counter()
    for e in range(epochs):
        ds.set_epoch(e + 1)
        for item in ds:
            n += len(item["image"]) > 0
    return (time.perf_counter() - t) / n * 1e6


def machinery_mosaic(out: Path, epochs: int) -> float:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=str(out), shuffle=True, batch_size=BATCH)
    n, t = 0, time.perf_counter()
    for _ in range(epochs):
        for item in ds:
            n += len(item["image"]) > 0
    del ds
    return (time.perf_counter() - t) / n * 1e6


def machinery_webdataset(fp: Path, epochs: int) -> float:
    import webdataset as wds

    urls = sorted(str(p) for p in fp.glob("train-*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=100, empty_check=False).shuffle(1000)
    n, t = 0, time.perf_counter()
    for _ in range(epochs):
        for item in ds:
            n += len(item["jpg"]) > 0
    return (time.perf_counter() - t) / n * 1e6


# -- loading: DataLoader workers, batch 64, crop 224 + flip → uint8 --------------------------------------------
_RNG = np.random.default_rng()


def decode_same(data) -> torch.Tensor:
    return torch.from_numpy(cpu_ops.decode_train(data, SIZE, _RNG))


_TV = None


def decode_idiomatic(data) -> torch.Tensor:
    """simplejpeg + torchvision transforms v2 on the uint8 tensor: what a peer's user writes."""
    global _TV
    import simplejpeg
    from torchvision.transforms import v2

    if _TV is None:
        _TV = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])
    return _TV(torch.from_numpy(simplejpeg.decode_jpeg(bytes(data), fastdct=True)).permute(2, 0, 1))


DECODERS = {"same": decode_same, "idiomatic": decode_idiomatic}


def _decoded(base):
    """A peer's dataset class whose items are decoded (image tensor, label) pairs: what its users subclass."""

    class Decoded(base):
        def __init__(self, *a, decode="same", **k):
            super().__init__(*a, **k)
            self.decode = decode

        def __getitem__(self, index):
            item = super().__getitem__(index)
            return DECODERS[self.decode](item["image"]), item["label"]

    return Decoded


def _wds_decode(decode: str):
    def fn(sample):
        return DECODERS[decode](sample["jpg"]), int(sample["cls"])

    return fn


def loaders(paths: dict, workers: int) -> dict:
    """name → a function building (iterable, set_epoch)."""
    from torch.utils.data import DataLoader

    from fastpipe import make_loader

    def fastpipe(threads):
        loader = make_loader(paths["fastpipe"], "torch", batch_size=BATCH, image_size=SIZE, num_workers=workers,
                             threads=threads, device="cpu", normalize=False)
        return loader, loader.set_epoch

    def litdata(decode):
        from litdata import StreamingDataLoader, StreamingDataset

        ds = _decoded(StreamingDataset)(str(paths["litdata"]), shuffle=True, drop_last=True, decode=decode)
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, drop_last=True,
                                     persistent_workers=True)
        return loader, lambda e: None  # its loader counts the epochs itself

    def mosaic(decode):
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        from streaming import StreamingDataset

        ds = _decoded(StreamingDataset)(local=str(paths["mosaic"]), shuffle=True, batch_size=BATCH, decode=decode)
        return DataLoader(ds, batch_size=BATCH, num_workers=workers, drop_last=True,
                          persistent_workers=True), lambda e: None

    def webdataset(decode):
        import webdataset as wds

        urls = sorted(str(p) for p in Path(paths["fastpipe"]).glob("train-*.tar"))
        ds = wds.WebDataset(urls, shardshuffle=100, empty_check=False).shuffle(1000).map(_wds_decode(decode)) \
            .batched(BATCH, partial=False)
        return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True), lambda e: None

    out = {name: (lambda t=threads: fastpipe(t)) for name, threads in FASTPIPE.items()}
    for d in DECODERS:
        out[f"litdata, {d} decode"] = lambda d=d: litdata(d)
        out[f"mosaic, {d} decode"] = lambda d=d: mosaic(d)
        out[f"webdataset, {d} decode"] = lambda d=d: webdataset(d)
    return out


def run_loader(build, epochs: int) -> dict:
    """First epoch (construction + worker start + the epoch) in seconds, then images/s over `epochs` more."""
    t = time.perf_counter()
    loader, set_epoch = build()
    first = sum(len(x) for x, _ in loader)
    first_s = time.perf_counter() - t
    n, t = 0, time.perf_counter()
    for e in range(1, epochs + 1):
        set_epoch(e)
        n += sum(len(x) for x, _ in loader)
    rate = n / (time.perf_counter() - t)
    # Teardown, timed apart and finished here: a loader whose workers are still being joined when the next
    # variant starts would charge that variant (litdata's took 10 s, torch's join timeout per worker).
    t = time.perf_counter()
    if hasattr(loader, "close"):
        loader.close()
    del loader, set_epoch
    gc.collect()
    return {"first_epoch_s": first_s, "first_epoch_images": first, "img_per_s": rate,
            "teardown_s": time.perf_counter() - t}


def decode_bound(fp: Path, passes: int = 2) -> dict:
    """One process, no loader: decode + random-resized-crop + flip → uint8 of the stored images."""
    from fastpipe.dataset.loading import load
    from fastpipe.loaders.epoch import Piece
    from fastpipe.loaders.shards import ShardSet

    shards = ShardSet(load(fp), "train")
    datas = [s.image for i, n in enumerate(shards.counts) for s in shards.read_piece(Piece(i, 0, n))]
    for d in datas[:20]:
        decode_same(d)
    t = time.perf_counter()
    for d in datas * passes:
        decode_same(d)
    return {"img_per_s": passes * len(datas) / (time.perf_counter() - t)}


def main(args) -> dict:
    torch.set_num_threads(1)  # the main process only collates; the workers decode
    base = Path(tempfile.mkdtemp(prefix="fp-peers-"))
    try:
        raw = photos(args, base)
        convert_fastpipe(raw, base / "fp", args.workers)  # warm-up; its rejections are left out for the peers
        rejected = {json.loads(line)["path"] for line in (base / "fp" / "rejected.jsonl").read_text().splitlines()}
        items = items_of(raw, {str(raw / p) for p in rejected} | rejected)
        conv = conversion(raw, items, base, args)
        if args.only_conversion:
            return {"photos": len(items), "workers": args.workers, "conversion": {**conv, **overheads(items)},
                    "versions": _versions()}
        paths = {"fastpipe": base / "fp", "litdata": base / "conv-litdata", "mosaic": base / "conv-mosaic"}
        print("per-sample machinery:", flush=True)
        mach = interleaved({
            "fastpipe": lambda: machinery_fastpipe(paths["fastpipe"], 10),
            "litdata": lambda: machinery_litdata(paths["litdata"], 10),
            "mosaic": lambda: machinery_mosaic(paths["mosaic"], 10),
            "webdataset": lambda: machinery_webdataset(paths["fastpipe"], 10)}, args.rounds)
        print("loading:", flush=True)
        variants = {k: (lambda b=b: run_loader(b, args.epochs)) for k, b in loaders(paths, args.workers).items()}
        variants[BOUND] = lambda: decode_bound(paths["fastpipe"])
        load_runs = interleaved(variants, args.rounds)
        return report(args, conv, overheads(items), mach, load_runs, len(items))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(args, conv, over, mach, load_runs, photos_n) -> dict:
    bound = load_runs.pop(BOUND)
    rate = {k: spread([r["img_per_s"] for r in v]) for k, v in load_runs.items()}
    first = {k: spread([r["first_epoch_s"] for r in v]) for k, v in load_runs.items()}
    # Ratios of paired rounds (the same round's runs), then their median: drift cancels within a round.
    head = load_runs[HEAD]
    paired = {k: spread([a["img_per_s"] / b["img_per_s"] for a, b in zip(head, v)])
              for k, v in load_runs.items() if k != HEAD}
    vs_bound = {k: spread([a["img_per_s"] / (args.workers * b["img_per_s"]) for a, b in zip(load_runs[k], bound)])
                for k in FASTPIPE}
    first_vs = {k: spread([b["first_epoch_s"] / a["first_epoch_s"] for a, b in zip(head, v)])
                for k, v in load_runs.items() if k != HEAD}
    return {"photos": photos_n, "workers": args.workers, "rounds": args.rounds, "batch": BATCH, "size": SIZE,
            "conversion": {**conv, **over},
            "machinery_us": {k: spread(v) for k, v in mach.items()},
            "loading": {"img_per_s": rate, "first_epoch_s": first, "fastpipe_over_peer": paired,
                        "peer_first_epoch_over_fastpipe": first_vs,
                        "bound_per_process": spread([b["img_per_s"] for b in bound]), "fastpipe_vs_bound": vs_bound},
            "versions": _versions()}


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "torchvision", "litdata", "mosaicml-streaming", "webdataset", "simplejpeg", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _r(v: dict, fmt: str = ".2f") -> str:
    return f"{v['median']:{fmt}} ({v['low']:{fmt}}-{v['high']:{fmt}})"


def table(res: dict) -> str:
    c = res["conversion"]
    lines = [f"{res['photos']} photos, {res['workers']} workers (median, range)", "",
             f"conversion, images/s in the call ({res['conversion'].get('mode', 'in process')}):"]
    lines += [f"  {k:<36} {_r(v, '.1f')}   CPU s, calling process {c['cpu_s'][k]['main_cpu_s']['median']:.2f}, "
              f"workers {c['cpu_s'][k]['workers_cpu_s']['median']:.2f}" for k, v in c["rates"].items()]
    peers = [k for k in c["rates"] if k != "fastpipe"]
    lines += ["  fastpipe ÷ " + ", ÷ ".join(f"{k} {_r(c[f'fastpipe_vs_{k}'])}" for k in peers)
              + f", ÷ (workers × one-process bound {_r(c['bound_per_process'], '.1f')}) {_r(c['fastpipe_vs_bound'])} "
              f"(paired rounds); mean/std {c['mean_std_share']:.1%} and hashing {c['hash_share']:.1%} of an "
              f"image's time"]
    if "loading" not in res:
        return "\n".join(lines)
    m, ld = res["machinery_us"], res["loading"]
    lines += ["", "per-sample machinery (µs: bytes fetched, shuffled, handed to decode; one process):"]
    lines += [f"  {k:<12} {v['median']:8.2f}  ({v['low']:.2f}-{v['high']:.2f})" for k, v in m.items()]
    lines += ["", f"loading, images/s after the first epoch; first epoch (s); {HEAD} ÷ it (paired rounds):"]
    for k, v in ld["img_per_s"].items():
        ratio = ld["fastpipe_over_peer"].get(k)
        lines.append(f"  {k:<28} {v['median']:8.0f}  ({v['low']:.0f}-{v['high']:.0f})  "
                     f"{ld['first_epoch_s'][k]['median']:6.2f} s"
                     + (f"   {ratio['median']:.2f} ({ratio['low']:.2f}-{ratio['high']:.2f})" if ratio else ""))
    b = ld["bound_per_process"]
    lines.append(f"  one-process decode bound {b['median']:.0f} img/s ({b['low']:.0f}-{b['high']:.0f}); ÷ (workers × "
                 f"bound): " + ", ".join(f"{k} {_r(v)}" for k, v in ld["fastpipe_vs_bound"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    a = parse_args()
    if a.convert_one:
        tool, items_json, out_dir = a.convert_one
        items = [tuple(it) for it in json.loads(Path(items_json).read_text())]
        print(json.dumps(convert_timed(tool, Path(a.raw), items, Path(out_dir), a.workers)))
        sys.exit(0)
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))

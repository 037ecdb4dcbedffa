"""Loader throughput, data only (no model): the plain webdataset pipeline of its docs vs fastpipe's backends,
on the same shards and worker count, against the single-process decode + crop + flip bound.

    python benchmarks/bench_loaders.py --workers 2 --json bench-results/loaders.json --plot bench-results/loaders.png

Targets (CPU): torch backend >= 2x the plain webdataset pipeline, and >= 0.8 x workers x the per-core bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from fastpipe import make_loader
from fastpipe.bench.timing import cuda_sync, endless, measure
from fastpipe.dataset.loading import load
from fastpipe.loaders import cpu_ops, jpegcrop
from fastpipe.loaders.epoch import Piece
from fastpipe.loaders.shards import ShardSet


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a converted data set (default: demo photos, generated and sharded)")
    ap.add_argument("--photos", type=int, default=800, help="demo photos to generate without --shards")
    ap.add_argument("--short-side", type=int, default=320, help="stored short side for generated shards")
    ap.add_argument("--workers", default=str(os.cpu_count() or 1), help="comma-separated worker counts")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--window-images", type=int, default=1536, help="images per timing window")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", help="comma-separated subset of the variants")
    ap.add_argument("--json", default="bench-results/loaders.json")
    ap.add_argument("--plot", default="bench-results/loaders.png")
    return ap.parse_args(argv)


def make_shards(args) -> Path:
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.driver import ShardConfig, shard

    base = Path(tempfile.mkdtemp(prefix="fp-bench-loaders-"))
    # Half-size photos generate 4x faster; the stored 320-px images are the same kind either way.
    make_demo_data(DemoConfig(base / "raw", count=args.photos, width=1632, height=1224))
    shard(ShardConfig(base / "raw", base / "shards", short_side=args.short_side, max_shard_size=4 * 2**20,
                      val_fraction=0.05))
    return base / "shards"


def bound(out: Path, size: int) -> dict[str, float]:
    """Single process, no loader: decode + random-resized-crop + flip → uint8, per decoder."""
    shards = ShardSet(load(out), "train")
    datas = [s.image for i, n in enumerate(shards.counts) for s in shards.read_piece(Piece(i, 0, n))][:1500]
    rates = {}
    for decoder in ("pillow", "simplejpeg") + (("crop",) if jpegcrop.ext is not None else ()):
        rng = np.random.default_rng(0)
        it = iter(endless(lambda _e: datas))

        def step():
            cpu_ops.decode_train(next(it), size, rng, decoder=decoder)  # noqa: B023
            return 1

        rates[decoder] = measure(step, warmup=20, window_images=400).img_per_s
    return rates


def plain_webdataset(out: Path, args):
    """What webdataset's docs show: decode("pil") + torchvision transforms + default collate."""
    import torchvision.transforms as T
    import webdataset as wds

    m = load(out)
    tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(m.mean, m.std)])
    ds = (wds.WebDataset(m.shard_paths("train"), shardshuffle=100, nodesplitter=wds.split_by_node)
          .shuffle(1000).decode("pil").to_tuple("jpg", "cls").map_tuple(tf, int))
    return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers_now,
                                       persistent_workers=args.workers_now > 0)


def variants(out: Path, args, workers: int) -> dict:
    # uint8 is what the loaders hand to the device step (the bound ends at uint8 too); on a GPU the float
    # conversion runs there. One row shows what that conversion costs when the "device" is this CPU.
    kw = dict(batch_size=args.batch_size, image_size=args.image_size, num_workers=workers, device="cpu",
              normalize=False)
    # Default settings (buffers reused once a batch is dropped), the workers as threads and as processes.
    threads, processes = {**kw, "threads": True}, {**kw, "threads": False}
    v = {
        "webdataset (docs), float": lambda: plain_webdataset(out, args),
        "fastpipe torch, uint8, threads": lambda: make_loader(out, "torch", **threads),
        "fastpipe torch, uint8, processes": lambda: make_loader(out, "torch", **processes),
        "fastpipe torch, float on cpu": lambda: make_loader(out, "torch", **{**kw, "normalize": True}),
        "fastpipe torch full decode (simplejpeg), uint8, threads":
            lambda: make_loader(out, "torch", cpu_decoder="simplejpeg", **threads),
        "fastpipe torch full decode (simplejpeg), uint8, processes":
            lambda: make_loader(out, "torch", cpu_decoder="simplejpeg", **processes),
        "fastpipe torch pillow, uint8, threads": lambda: make_loader(out, "torch", cpu_decoder="pillow", **threads),
        "fastpipe torch pillow, uint8, processes": lambda: make_loader(out, "torch", cpu_decoder="pillow",
                                                                       **processes),
        "fastpipe nvjpeg cpu-decode, uint8": lambda: make_loader(out, "nvjpeg", **kw),
        "fastpipe dali cpu, uint8": lambda: make_loader(out, "dali", **kw),
    }
    if args.device.startswith("cuda"):
        gkw = {**kw, "device": args.device, "normalize": True}
        v["fastpipe torch -> gpu, float"] = lambda: make_loader(out, "torch", **gkw)
        v["fastpipe nvjpeg gpu-decode, float"] = lambda: make_loader(out, "nvjpeg", **gkw)
        v["fastpipe dali gpu-decode, float"] = lambda: make_loader(out, "dali", **gkw)
    if args.only:
        keep = args.only.split(",")
        v = {k: f for k, f in v.items() if any(s in k for s in keep)}
    return v


def run_variant(factory, args) -> dict:
    loader = factory()
    device = getattr(loader, "device", torch.device("cpu"))

    def epoch(e):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        return loader

    it = endless(epoch)

    def step():
        x, _ = next(it)
        return len(x)

    t = measure(step, warmup=3, window_images=args.window_images, sync=cuda_sync(device))
    return {**t.as_dict(), "workers": args.workers_now}


def plot(rows: dict, bound_total: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    vals = [rows[n]["img_per_s"] for n in names]
    errs = [[v - rows[n]["low"] for n, v in zip(names, vals)], [rows[n]["high"] - v for n, v in zip(names, vals)]]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) + 1.5))
    ax.barh(names, vals, xerr=errs, color=["#999" if "docs" in n else "#2a7" for n in names])
    ax.axvline(bound_total, color="k", ls="--", label="per-core bound (one process)")
    ax.invert_yaxis()
    ax.set_xlabel("images/s (median of 3 windows, range as error bar)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(args) -> dict:
    out = Path(args.shards) if args.shards else make_shards(args)
    try:
        per_core = bound(out, args.image_size)
        best = max(per_core.values())
        rows, failed = {}, {}
        for workers in [int(w) for w in args.workers.split(",")]:
            args.workers_now = workers
            for name, factory in variants(out, args, workers).items():
                try:
                    rows[f"{name} [{workers}w]"] = r = run_variant(factory, args)
                except ImportError as e:
                    print(f"skipped {name}: {e}")
                    continue
                except Exception as e:  # one variant's failure (e.g. webdataset: fewer shards than workers)
                    failed[f"{name} [{workers}w]"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    print(f"FAILED {name} [{workers}w]: {failed[f'{name} [{workers}w]']}")
                    continue
                finally:
                    gc.collect()  # free DALI pipelines before the next variant forks its workers
                r["vs_bound"] = r["img_per_s"] / (best * workers)
        print("per-core bound, decode + random-resized-crop + flip -> uint8, one process: "
              + ", ".join(f"{k} {v:,.0f} img/s" for k, v in per_core.items()))
        print(f"{'variant':58s} {'img/s':>8s} {'range':>15s} {'vs docs':>8s} {'vs bound':>9s}")
        for name, r in rows.items():
            base = rows.get(f"webdataset (docs), float [{r['workers']}w]", {}).get("img_per_s")
            r["vs_webdataset_docs"] = r["img_per_s"] / base if base else None
            print(f"{name:58s} {r['img_per_s']:8,.0f} {r['low']:7,.0f}-{r['high']:<7,.0f} "
                  f"{(r['vs_webdataset_docs'] or 0):7.2f}x {r['vs_bound']:8.2f}")
        m = load(out)
        result = {"benchmark": "loaders", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                       "torch": torch.__version__, "device": args.device},
                  "decoder": cpu_ops.active(),
                  "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                  "train_samples": m.splits["train"].samples, "stored_short_side": m.settings.get("short_side"),
                  "bound_per_core_img_per_s": per_core, "rows": rows, "failed": failed}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
        if args.plot:
            plot(rows, best, args.plot,
                 f"Loaders alone, batch {args.batch_size}, {args.image_size}px, stored short side "
                 f"{m.settings.get('short_side')}\n[Nw] = N workers; dashed: the single-process bound per core")
        return result
    finally:
        if not args.shards:
            shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    # Every variant that ran is written down; a failed one still fails the command, so it is never missed.
    raise SystemExit(1 if main(parse_args())["failed"] else 0)

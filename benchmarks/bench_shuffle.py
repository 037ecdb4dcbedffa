"""Shuffle quality of the train order: how many shards and how close to the data set's class mix each batch is,
for several world sizes and worker counts (the order must not depend on them), against uniformly random batches.

    python benchmarks/bench_shuffle.py [--shards OUT] [--batch-size 64] --json bench-results/shuffle.json

Without --shards it makes a 2,120-image, 6-class set with a 20:1 imbalance in 148 small shards (the demo's class
mix, tiny images: only the order is measured, nothing is decoded).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from fastpipe.dataset.loading import load
from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.prepare import Raw
from fastpipe.loaders.shards import ShardSet
from fastpipe.loaders.stream import SampleStream, train_order

COUNTS = {"leaf_healthy": 800, "leaf_rust": 360, "leaf_blight": 200, "pipe_clean": 560, "pipe_crack": 160,
          "pipe_corrosion": 40}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a converted data set (default: made in a temporary folder)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--json", default="bench-results/shuffle.json")
    return ap.parse_args(argv)


def make_set() -> Path:
    from PIL import Image

    from fastpipe.convert.driver import ShardConfig, shard

    base, rng = Path(tempfile.mkdtemp(prefix="fp-shuffle-")), np.random.default_rng(0)
    for k, (name, n) in enumerate(COUNTS.items()):
        (base / "src" / name).mkdir(parents=True)
        for i in range(n):
            a = np.clip(rng.normal(40 * k, 30, (120, 160, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(a).save(base / "src" / name / f"{i:04d}.jpg", quality=85)
    shard(ShardConfig(base / "src", base / "out", short_side=96, max_shard_size=128 * 1024))
    return base / "out"


def measure(out: Path, world: int, workers: int, batch: int, epochs: int) -> dict:
    m = load(out)
    counts = np.array(m.splits["train"].class_counts, dtype=float)
    share = counts / counts.sum()
    shards_per, tv = [], []
    for epoch in range(epochs):
        for rank in range(world):
            cfg = LoaderConfig(batch_size=batch, image_size=32, rank=rank, world_size=world).resolved()
            s = ShardSet(m, "train")
            stream = SampleStream(s, cfg, Raw(cfg, m.num_classes), train_order(s, cfg, m))
            stream.epoch[0] = epoch
            for w in range(workers):
                for ids, _pos in stream.plan(w, workers):
                    shards_per.append(len(set(s.shard_of(ids).tolist())))
                    labels = [s.sample(int(i)).label for i in ids]
                    tv.append(0.5 * np.abs(np.bincount(labels, minlength=len(share)) / len(labels) - share).sum())
    return {"world": world, "workers": workers, "shards_per_batch": float(np.mean(shards_per)),
            "class_tv_distance": float(np.mean(tv)), "batches": len(tv)}


def ideal(out: Path, batch: int) -> float:
    m = load(out)
    counts = np.array(m.splits["train"].class_counts)
    labels, rng = np.repeat(np.arange(len(counts)), counts), np.random.default_rng(0)
    share = counts / counts.sum()
    return float(np.mean([0.5 * np.abs(np.bincount(rng.choice(labels, batch, replace=False), minlength=len(counts))
                                       / batch - share).sum() for _ in range(500)]))


def main(args) -> dict:
    out = Path(args.shards) if args.shards else make_set()
    m = load(out)
    rows = [measure(out, w, k, args.batch_size, args.epochs) for w, k in ((1, 1), (1, 2), (2, 4), (8, 8))]
    result = {"benchmark": "shuffle", "train_samples": m.splits["train"].samples,
              "train_shards": len(m.splits["train"].shards), "batch_size": args.batch_size, "rows": rows,
              "random_batches_class_tv_distance": ideal(out, args.batch_size)}
    print(f"{result['train_samples']} train samples in {result['train_shards']} shards, batch {args.batch_size}")
    print(f"{'world':>5s} {'workers':>7s} {'shards/batch':>12s} {'class TV':>9s}")
    for r in rows:
        print(f"{r['world']:5d} {r['workers']:7d} {r['shards_per_batch']:12.1f} {r['class_tv_distance']:9.3f}")
    print(f"uniformly random batches: class TV {result['random_batches_class_tv_distance']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(parse_args())

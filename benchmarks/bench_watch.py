"""What watching costs the loop it watches: images/s of a training loop over a fastpipe loader, plain against wrapped
in `fastpipe.watch`, interleaved in one process (each round --epochs plain and --epochs watched, the order alternating:
drift in the machine's speed hits both alike), and what the loader's always-on stage timing adds to each batch.

The step is a stand-in for a training step: it holds the GIL for --python-ms (the step's Python: launches, optimizer
bookkeeping) and then sleeps --sleep-ms (the device working). Figures: each round's pair of epochs gives a ratio
(watched / plain images/s); the median over rounds and its range.

    python benchmarks/bench_watch.py --rounds 9 --json docs/results/watch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a converted data set (default: demo photos, generated and sharded)")
    ap.add_argument("--photos", type=int, default=640, help="demo photos to generate without --shards")
    ap.add_argument("--short-side", type=int, default=320)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--python-ms", type=float, default=3.0, help="the step holds the GIL this long")
    ap.add_argument("--sleep-ms", type=float, default=10.0, help="then sleeps this long (the device working)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--epochs", type=int, default=5, help="epochs of each kind a round")
    ap.add_argument("--json", default="bench-results/watch.json")
    return ap.parse_args(argv)


def make_shards(args, base: Path) -> Path:
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.driver import ShardConfig, shard

    make_demo_data(DemoConfig(base / "raw", count=args.photos, width=1632, height=1224))
    shard(ShardConfig(base / "raw", base / "shards", short_side=args.short_side, max_shard_size=4 * 2**20,
                      val_fraction=0))
    return base / "shards"


def step(python_s: float, sleep_s: float) -> None:
    end = time.perf_counter() + python_s
    while time.perf_counter() < end:  # pure Python: holds the GIL, as a step's own code does
        pass
    time.sleep(sleep_s)


def epochs(loader, watched, args, count: int) -> float:
    """images/s of `count` epochs of the loop, watched (one watch over them all, as a training script would) or
    not."""
    import fastpipe

    it = fastpipe.watch(loader, log=lambda line: None) if watched else loader
    n, start = 0, time.perf_counter()
    for _ in range(count):
        for x, _ in it:
            step(args.python_ms / 1000, args.sleep_ms / 1000)
            n += len(x)
    return n / (time.perf_counter() - start)


def stage_timing_cost(loader, args) -> dict:
    """The per-batch work stage timing adds, timed alone: the clock reads of a batch (read, each chunk of 8 samples'
    decode, assemble, the device step) and the merge of its stages into loader.stats, against the batch's own
    loader time (its stages' sum, over its workers)."""
    reads = 6 + 2 * -(-args.batch_size // 8)
    clock = min(timeit.repeat(time.perf_counter, number=10_000, repeat=5)) / 10_000 * reads
    stages, batch = {"read": 1.0, "decode": 1.0, "assemble": 1.0, "device": 1.0}, {"read": 1.0, "decode": 1.0}

    def merge():
        for k, v in batch.items():
            stages[k] = stages.get(k, 0.0) + v

    merge_s = min(timeit.repeat(merge, number=10_000, repeat=5)) / 10_000
    per_batch = sum(loader.stats.stages.values()) / max(loader.stats.batches, 1)
    return {"clock_reads_per_batch": reads, "seconds_per_batch": clock + merge_s,
            "loader_seconds_per_batch": per_batch, "share": (clock + merge_s) / per_batch}


def main(argv=None) -> int:
    args = parse_args(argv)
    import fastpipe

    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        shards = Path(args.shards) if args.shards else make_shards(args, Path(tmp))
        loader = fastpipe.make_loader(shards, batch_size=args.batch_size, image_size=args.image_size, device="cpu",
                                      num_workers=args.workers)
        epochs(loader, False, args, 1)  # the page cache and the workers' first start: untimed
        rounds = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            rate = {w: epochs(loader, w, args, args.epochs) for w in order}
            rounds.append({"plain": rate[False], "watched": rate[True], "ratio": rate[True] / rate[False]})
            print(f"round {r + 1}: plain {rate[False]:.1f}, watched {rate[True]:.1f} img/s, "
                  f"ratio {rounds[-1]['ratio']:.3f}", flush=True)
        cost = stage_timing_cost(loader, args)
        describe = loader.describe()
        loader.close()
    ratios = [r["ratio"] for r in rounds]
    out = {"command": " ".join(["python", *sys.argv]), "settings": vars(args), "loader": {
        k: describe.get(k) for k in ("backend", "num_workers", "workers_are", "cpu_decoder")},
           "rounds": rounds, "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
           "plain_median": statistics.median(r["plain"] for r in rounds),
           "watched_median": statistics.median(r["watched"] for r in rounds), "stage_timing": cost}
    print(f"watched / plain: median {out['ratio_median']:.3f} (range {min(ratios):.3f}-{max(ratios):.3f}) over "
          f"{args.rounds} rounds; stage timing: {cost['seconds_per_batch'] * 1e6:.1f} us a batch, "
          f"{cost['share']:.4%} of the loader's {cost['loader_seconds_per_batch'] * 1000:.0f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

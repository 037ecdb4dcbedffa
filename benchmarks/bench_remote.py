"""Reading a data set from a store: loader images/s over loopback HTTP with added latency, against the local disk.

The same shards are served by fastpipe.testing.devserver in its own process (Range requests, `--latency` ms added to
every request, as a store's time to first byte) and read with an empty node cache (the first epoch on a fresh machine:
every byte comes over HTTP), then by a new loader from the filled cache (a later run, or epoch). Local and remote
runs are interleaved in rounds; medians with ranges. On a machine whose cores all decode, the server's and the reading
path's CPU time (HTTP client, cache writes, sha256 checks) comes out of decoding: the table gives both, as the
loader workers' CPU seconds beside local's and the server process's (a real store's CPU is not yours).

    python benchmarks/bench_remote.py --workers 2 --latency 0,20,100 --json docs/results/remote.json

Target: >= 0.9 x local at 20 ms with 2 workers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fastpipe import make_loader
from fastpipe.dataset.loading import load


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a converted data set (default: demo photos, generated and sharded)")
    ap.add_argument("--photos", type=int, default=6400,
                    help="demo photos to generate without --shards (6400: about 6,000 train images, 100 MB, a "
                         "few seconds an epoch, so that start-up is not most of it; about 5 minutes to make)")
    ap.add_argument("--photo-size", default="1632x1224",
                    help="WxH of the demo photos without --shards (the shards hold them at 320 px on the short side "
                         "either way: 640x480 makes a larger set, for epochs of many seconds, in a few minutes)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", choices=["on", "off", "auto"], default="auto",
                    help="loader workers as threads (on), processes (off), or fastpipe's default (auto)")
    ap.add_argument("--latency", default="0,20,100", help="comma-separated ms added to each request")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="bench-results/remote.json")
    ap.add_argument("--plot", default="bench-results/remote.png")
    return ap.parse_args(argv)


def make_shards(args) -> Path:
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.driver import ShardConfig, shard

    base = Path(tempfile.mkdtemp(prefix="fp-bench-remote-"))
    width, height = (int(v) for v in args.photo_size.lower().split("x"))
    make_demo_data(DemoConfig(base / "raw", count=args.photos, width=width, height=height))
    shard(ShardConfig(base / "raw", base / "shards", short_side=320, max_shard_size=4 * 2**20, val_fraction=0.05))
    return base / "shards"


@contextlib.contextmanager
def served(folder: Path, ms: float):
    """A FolderServer in a process of its own (a store is not in the trainer's process)."""
    code = ("import sys, time; from fastpipe.testing.devserver import Faults, FolderServer\n"
            "with FolderServer(sys.argv[1], Faults(latency=float(sys.argv[2]))) as url:\n"
            "    print(url, flush=True); time.sleep(3600)")
    p = subprocess.Popen([sys.executable, "-c", code, str(folder), str(ms / 1000)], stdout=subprocess.PIPE, text=True)
    try:
        yield p.stdout.readline().strip(), p.pid
    finally:
        p.kill()
        p.wait()


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time of the loader (this process, whose threads are its workers in thread mode, and its ended child
    processes: its worker processes, once closed), or of process `pid`."""
    if pid is None:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                       resource.getrusage(resource.RUSAGE_CHILDREN)))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_epoch(where, args, cache: Path | None, keep: bool = False, server: int | None = None) -> dict:
    kw = dict(split="train", batch_size=args.batch_size, image_size=args.image_size, num_workers=args.workers,
              device="cpu", normalize=False, threads={"on": True, "off": False}.get(args.threads))
    if cache is not None:
        if not keep:
            shutil.rmtree(cache, ignore_errors=True)
        kw["cache_dir"] = cache
    workers, served_cpu = cpu_seconds(), cpu_seconds(server) if server else 0.0
    start = time.perf_counter()
    loader = make_loader(where, **kw)
    it = iter(loader)
    n = len(next(it)[1])
    first = time.perf_counter()  # construction (indexes fetched), worker start and the first batch
    n += sum(len(y) for _, y in it)
    end = time.perf_counter()
    loader.close()
    s = loader.stats
    return {"img_per_s": n / (end - start), "steady_img_per_s": (n - args.batch_size) / (end - first),
            "first_batch_s": first - start, "requests": s.requests, "mb": s.fetched_bytes / 1e6,
            "retries": s.retries, "worker_cpu_s": cpu_seconds() - workers,
            "server_cpu_s": cpu_seconds(server) - served_cpu if server else 0.0}


def main(args) -> dict:
    shards = Path(args.shards) if args.shards else make_shards(args)
    latencies = [float(x) for x in args.latency.split(",")]
    m = load(shards)
    train_mb = sum(s.bytes for s in m.split("train").shards) / 1e6
    print(f"{m.split('train').samples} train images in {len(m.split('train').shards)} shards ({train_mb:.1f} MB), "
          f"{args.workers} workers, batch {args.batch_size}, {args.image_size} px")
    cache = Path(tempfile.mkdtemp(prefix="fp-remote-cache-"))
    runs: dict[str, list[dict]] = {"local": []}
    one_epoch(shards, args, None)  # warm the page cache and the imports
    for r in range(args.rounds):
        runs["local"].append(one_epoch(shards, args, None))
        for ms in latencies:
            with served(shards, ms) as (url, pid):
                runs.setdefault(f"{ms:g} ms", []).append(one_epoch(url, args, cache, server=pid))
                if ms == latencies[-1]:
                    runs.setdefault("cached", []).append(one_epoch(url, args, cache, keep=True, server=pid))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]['img_per_s']:.0f}" for k, v in runs.items()))
    local = np.median([x["img_per_s"] for x in runs["local"]])
    rows = []
    for name, xs in runs.items():
        row = {"source": name, "requests": xs[-1]["requests"], "mb": xs[-1]["mb"],
               **{k: float(np.median([x[k] for x in xs])) for k in ("first_batch_s", "worker_cpu_s", "server_cpu_s")}}
        for key in ("img_per_s", "steady_img_per_s"):
            rates = [x[key] for x in xs]
            ratios = [x[key] / y[key] for x, y in zip(xs, runs["local"])]
            row.update({key: float(np.median(rates)), key + "_range": [min(rates), max(rates)],
                        key + "_vs_local": float(np.median(ratios)),
                        key + "_vs_local_range": [min(ratios), max(ratios)]})
        rows.append(row)
    print(f"\n{'source':>8} {'epoch img/s':>12} {'x local':>14} {'steady img/s':>13} {'x local':>14} "
          f"{'1st batch':>9} {'requests':>8} {'MB':>5} {'loader CPU':>10} {'server CPU':>10}")
    for r in rows:
        print(f"{r['source']:>8} {r['img_per_s']:12.0f} {_ratio(r, 'img_per_s'):>14} {r['steady_img_per_s']:13.0f} "
              f"{_ratio(r, 'steady_img_per_s'):>14} {r['first_batch_s']:8.2f}s {r['requests']:8d} {r['mb']:5.1f} "
              f"{r['worker_cpu_s']:9.2f}s {r['server_cpu_s']:9.2f}s")
    result = {"machine": platform.node(), "cpus": __import__("os").cpu_count(), "workers": args.workers,
              "threads": args.threads,
              "batch_size": args.batch_size, "image_size": args.image_size, "train_images": m.split("train").samples,
              "train_mb": train_mb, "local_img_per_s": float(local), "rows": rows, "rounds": args.rounds}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    plot(rows, args.plot)
    shutil.rmtree(cache, ignore_errors=True)
    return result


def _ratio(row: dict, key: str) -> str:
    lo, hi = row[key + "_vs_local_range"]
    return f"{row[key + '_vs_local']:.2f} ({lo:.2f}-{hi:.2f})"


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = np.arange(len(rows))
    for k, (key, label, color) in enumerate((("img_per_s", "whole epoch (with start-up)", "#999"),
                                             ("steady_img_per_s", "after the first batch", "#3a7"))):
        vals = [r[key] for r in rows]
        ax.bar(x + (k - 0.5) * 0.4, vals, 0.4, label=label, color=color)
        for i, r in enumerate(rows[1:], 1):
            ax.text(i + (k - 0.5) * 0.4, vals[i] * 0.5, f"{r[key + '_vs_local']:.2f}x", ha="center", fontsize=8,
                    color="white")
    ax.set_xticks(x, [r["source"] for r in rows])
    ax.set_ylabel("images/s")
    ax.set_title("Local disk vs loopback HTTP with added latency per request\n(empty cache; 'cached': a new "
                 "loader over the filled cache)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(parse_args())

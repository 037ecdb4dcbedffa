"""The converter's workers with glibc's default allocator settings against `util.reuse_freed_memory` (what they
run with), interleaved in one run: images/s of a whole `shard()` call, and the workers' CPU time and page faults
per image.

    python benchmarks/bench_malloc.py --raw RAW_FOLDER --rounds 7 --json bench-results/malloc.json

Each run is a fresh Python process that calls the converter's `shard()` once, as a user's script or notebook does: glibc
adjusts its thresholds as a process allocates and frees, and forked workers inherit that state, so a process that
had already converted would measure something else. Without RAW a demo set (200 photos, 1632x1224) is generated.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fastpipe.bench.timing import run_fresh, spread

VARIANTS = ("glibc default", "reuse_freed_memory")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", help="class folders of photos (default: demo photos, generated)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="bench-results/malloc.json")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a single run, in its own process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def one(args) -> dict:
    """A single conversion in this (fresh) process; the workers' figures come from RUSAGE_CHILDREN once joined."""
    from fastpipe.convert import workers
    from fastpipe.convert.driver import ShardConfig, shard

    if args.one == "glibc default":
        workers.reuse_freed_memory = lambda: False
    t = time.perf_counter()
    summary = shard(ShardConfig(Path(args.raw), Path(args.out), workers=args.workers, val_fraction=0))
    seconds = time.perf_counter() - t
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = sum(summary.written.values())
    return {"img_per_s": n / seconds, "worker_cpu_ms_per_img": (kids.ru_utime + kids.ru_stime) / n * 1e3,
            "worker_sys_ms_per_img": kids.ru_stime / n * 1e3, "worker_faults_per_img": kids.ru_minflt / n}


def run(args, variant: str, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return run_fresh([__file__, "--one", variant, "--raw", args.raw, "--out", str(out), "--workers",
                      str(args.workers)], f"the {variant!r} run")


def main(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="fp-bench-malloc-") as tmp:
        if not args.raw:
            from fastpipe.convert.demo import DemoConfig, make_demo_data

            make_demo_data(DemoConfig(Path(tmp) / "raw", count=200, width=1632, height=1224))
            args.raw = str(Path(tmp) / "raw")
        rng, runs = random.Random(0), {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in rng.sample(VARIANTS, len(VARIANTS)):
                runs[v].append(run(args, v, Path(tmp) / "out"))
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    res = {v: {k: spread([x[k] for x in rs]) for k in rs[0]} for v, rs in runs.items()}
    ratios = [b["img_per_s"] / a["img_per_s"] for a, b in zip(*runs.values())]
    return {"workers": args.workers, "rounds": args.rounds, "variants": res, "speedup": spread(ratios)}


def table(res: dict) -> str:
    lines = [f"{'':22s} {'img/s':>22s} {'worker CPU ms/img':>20s} {'of it system':>14s} {'faults/img':>12s}"]
    for v, r in res["variants"].items():
        cells = [r[k] for k in ("img_per_s", "worker_cpu_ms_per_img", "worker_sys_ms_per_img",
                                "worker_faults_per_img")]
        lines.append(f"{v:22s} {cells[0]['median']:8.1f} ({cells[0]['low']:.1f}-{cells[0]['high']:.1f})"
                     f" {cells[1]['median']:20.2f} {cells[2]['median']:14.2f} {cells[3]['median']:12.0f}")
    s = res["speedup"]
    lines.append(f"reuse_freed_memory ÷ default, paired: {s['median']:.2f} ({s['low']:.2f}-{s['high']:.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    a = parse_args()
    if a.one:
        print(json.dumps(one(a)))
        sys.exit(0)
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))

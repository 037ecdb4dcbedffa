"""Where a `shard()` call's wall time goes, against the one-process bound: its phases (discovery, hashing,
conversion, finishing: rejections, previews, manifest) and how busy the workers are while converting.

    python benchmarks/profile_convert.py --raw RAW_FOLDER --rounds 5 --json bench-results/convert-phases.json

Each round runs, in a shuffled order and each in a fresh Python process (as bench_malloc.py, for the same reason:
the allocator's state), one `shard()` call with `--workers` workers and the bound: the same per-image step
(`images.process` of every photo) in one process, nothing written. The workers' busy time is taken by wrapping
the pool's task function (`workers._each`) in the conversion's process before its workers fork; each worker
appends its tasks' start and end to a file. `without_hash_and_finish` is arithmetic, not a run: the images/s
if the hash and finish phases took no time, to size what they cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from fastpipe.bench.timing import run_fresh, spread

KINDS = ("shard", "bound")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", required=True, help="class folders of photos (e.g. from `fastpipe demo-data`)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench-results/convert-phases.json")
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a single run, in its own process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def bound(raw: Path) -> dict:
    from fastpipe.convert.images import Encoded, ImageSettings, process
    from fastpipe.util import reuse_freed_memory

    reuse_freed_memory()  # as the conversion workers have it
    files = sorted(p for p in raw.rglob("*") if p.is_file() and not p.name.startswith("."))
    settings = ImageSettings()
    t = time.perf_counter()
    # Counted as shard() counts: images written; the time of files it rejects (a broken one) is in both
    n = sum(isinstance(process(f.read_bytes(), settings), Encoded) for f in files)
    return {"img_per_s": n / (time.perf_counter() - t)}


_TASKS: dict = {}  # set in the conversion's process before its workers fork: they inherit it


def _timed_each(fn, chunk):
    """The pool's task function, timed (module level: the executor pickles it by name)."""
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across the processes of one machine
    done = _TASKS["each"](fn, chunk)
    with open(_TASKS["log"] / str(os.getpid()), "a") as f:
        f.write(f"{t0} {time.perf_counter()} {getattr(fn, '__name__', '')}\n")
    return done


def shard_once(raw: Path, out: Path, workers: int) -> dict:
    from fastpipe.convert import workers as pool
    from fastpipe.convert.driver import ShardConfig, shard

    log = out.with_suffix(".tasks")
    log.mkdir(parents=True, exist_ok=True)
    _TASKS.update(each=pool._each, log=log)
    pool._each = _timed_each
    start = time.perf_counter()
    summary = shard(ShardConfig(raw, out, workers=workers, val_fraction=0))
    wall = time.perf_counter() - start
    phases = dict(summary.phases)
    window = phases["convert"]  # the conversion phase, ending where the finish phase begins
    end = start + sum(v for k, v in phases.items() if k != "finish")
    busy = [sum(float(b) - float(a) for a, b, name in (line.split() for line in p.read_text().splitlines())
                if name == "convert_one" and end - window <= float(a) <= end) for p in log.iterdir()]
    n = sum(summary.written.values())
    return {"img_per_s": n / wall, "wall_s": wall, "images": n, "phases_s": phases,
            "worker_busy_in_convert": sum(busy) / (workers * window) if busy else None,
            "convert_phase_img_per_s": n / window,
            "without_hash_and_finish_img_per_s": n / (wall - phases["hash"] - phases["finish"])}


def run(args, kind: str, out: Path) -> dict:
    return run_fresh([__file__, "--one", kind, "--raw", args.raw, "--out", str(out), "--workers", str(args.workers)],
                     f"the {kind} run")


def main(args) -> dict:
    rng, runs = random.Random(0), {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="fp-profile-convert-") as tmp:
        for r in range(args.rounds):
            for kind in rng.sample(KINDS, len(KINDS)):
                runs[kind].append(run(args, kind, Path(tmp) / f"out-{r}"))
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    shards, bounds = runs["shard"], [b["img_per_s"] * args.workers for b in runs["bound"]]
    per = {k: spread([s[k] / b for s, b in zip(shards, bounds)])
           for k in ("img_per_s", "convert_phase_img_per_s", "without_hash_and_finish_img_per_s")}
    phases = {p: spread([s["phases_s"][p] for s in shards]) for p in shards[0]["phases_s"]}
    shares = {p: spread([s["phases_s"][p] / s["wall_s"] for s in shards]) for p in phases}
    return {"workers": args.workers, "rounds": args.rounds, "images": shards[0]["images"],
            "img_per_s": spread([s["img_per_s"] for s in shards]), "bound_img_per_s": spread(bounds),
            "vs_workers_x_bound": per, "phases_s": phases, "phase_share_of_wall": shares,
            "worker_busy_in_convert": _spread_known([s["worker_busy_in_convert"] for s in shards])}


def _spread_known(values: list) -> dict | None:
    """None where there was nothing to measure (one worker: `shard` converts in the calling process)."""
    known = [v for v in values if v is not None]
    return spread(known) if known else None


def table(res: dict) -> str:
    def r(s, f=".2f"):
        return f"{s['median']:{f}} ({s['low']:{f}}-{s['high']:{f}})"

    lines = [f"{res['images']} photos, {res['workers']} workers, {res['rounds']} rounds (median, range)",
             f"shard(): {r(res['img_per_s'], '.1f')} img/s; {res['workers']} x one-process bound "
             f"{r(res['bound_img_per_s'], '.1f')}"]
    lines += [f"  phase {p:8s} {r(res['phases_s'][p], '.3f')} s = {r(res['phase_share_of_wall'][p], '.1%')} of the call"
              for p in res["phases_s"]]
    v = res["vs_workers_x_bound"]
    lines += [f"÷ (workers x bound): whole call {r(v['img_per_s'])}; conversion phase alone "
              f"{r(v['convert_phase_img_per_s'])}; without hash and finish phases (arithmetic) "
              f"{r(v['without_hash_and_finish_img_per_s'])}",
              "workers busy during the conversion phase: " + (r(res["worker_busy_in_convert"], ".1%")
                                                               if res["worker_busy_in_convert"] else
                                                               "no worker processes (one worker converts in the "
                                                               "calling process)")]
    return "\n".join(lines)


if __name__ == "__main__":
    a = parse_args()
    if a.one:
        raw, out = Path(a.raw), Path(a.out)
        print(json.dumps(bound(raw) if a.one == "bound" else shard_once(raw, out, a.workers)))
        sys.exit(0)
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))

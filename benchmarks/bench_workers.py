"""Worker threads against worker processes, and against the threads in one helper process (the torch backend, the
same shards and settings): images/s over full epochs, the first epoch (construction + one epoch, in a fresh process
as a user's script meets it), the whole loader's memory and the /dev/shm it maps, against the one-process decode
bound.

Memory is anonymous memory (heap, buffers; library pages are left out: other processes on a shared machine share and
unshare them, which moved psutil's USS of one process by 200 MB between identical runs): USS, what the training
process gained since before the loader plus each worker process's unique part (pages a forked worker still shares
with the training process count in neither: this understates the processes); PSS, the same with shared pages
counted once, split among the processes sharing them. Both are taken half-way through an untimed epoch.

    python benchmarks/bench_workers.py --rounds 7 --json docs/results/workers.json

Every variant runs in a fresh Python process, once per round, in a shuffled order (drift in the machine's speed hits
all alike); the load average is recorded with each round. Figures are medians over rounds with their ranges, and
ratios are medians of each round's pairs. Work per image: decode + random-resized-crop 224 + flip -> uint8, batch 64.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

BOUND = "one-process decode bound"
BARE_THREADS = "the bare decode loop in threads"  # the bound's loop split over --workers threads: no loader
MODES = {"processes": False, "threads": True, "helper": "helper"}  # helper: the threads in one helper process
WORKERS_ARE = {False: "processes", True: "threads", "helper": "threads in a helper process"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a converted data set (default: demo photos, generated and sharded)")
    ap.add_argument("--photos", type=int, default=1100, help="demo photos to generate without --shards")
    ap.add_argument("--short-side", type=int, default=320)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--decoder", default="auto", help="cpu_decoder of both modes")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=4, help="timed epochs after the first")
    ap.add_argument("--python-ms", type=float, default=0, help="the training process's main thread spends this long "
                                                               "per batch in pure Python, holding the GIL")
    ap.add_argument("--settle", type=float, default=0, help="before each round, wait up to this many seconds for "
                                                             "other processes to use under 0.2 cores")
    ap.add_argument("--json", default="bench-results/workers.json")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # VARIANT SHARDS: one run, in this process
    return ap.parse_args(argv)


def make_shards(args, base: Path) -> Path:
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.driver import ShardConfig, shard

    make_demo_data(DemoConfig(base / "raw", count=args.photos, width=1632, height=1224))
    shard(ShardConfig(base / "raw", base / "shards", short_side=args.short_side, max_shard_size=4 * 2**20,
                      val_fraction=0))
    return base / "shards"


def shm_bytes(pids) -> int:
    """Bytes of /dev/shm files these processes map (each file once, however many map it)."""
    files = {}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                key = (parts[3], parts[4])  # device, inode
                files[key] = max(files.get(key, 0), hi - lo)
    return sum(files.values())


def anonymous(pid: int) -> dict:
    """A process's anonymous memory (heap, arenas, buffers; not the pages of libraries, which other processes on the
    machine share and unshare as they come and go): its unique part (USS) and its proportional part (PSS, which
    counts a page a forked worker still shares with the training process once across them)."""
    uss = pss = 0
    anon = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: address range, perms, ..., path
            path = head[5] if len(head) == 6 else ""
            anon = path == "" or (path.startswith("[") and path != "[vdso]" and path != "[vvar]")
        elif anon and head[0] in ("Private_Clean:", "Private_Dirty:"):
            uss += int(head[1]) * 1024
        elif anon and head[0] == "Pss:":
            pss += int(head[1]) * 1024
    return {"uss": uss, "pss": pss}


def memory(base: dict) -> dict:
    """The loader's memory now: what the training process gained since before the loader, and its workers'."""
    import psutil

    me = psutil.Process()
    kids = me.children(recursive=True)
    main, workers = anonymous(me.pid), [anonymous(k.pid) for k in kids]
    return {"uss_bytes": main["uss"] - base["uss"] + sum(w["uss"] for w in workers),
            "pss_bytes": main["pss"] - base["pss"] + sum(w["pss"] for w in workers),
            "main_uss_bytes": main["uss"] - base["uss"], "workers_uss_bytes": sum(w["uss"] for w in workers),
            "worker_processes": len(kids), "shm_bytes": shm_bytes([me.pid] + [k.pid for k in kids])}


def run_bound(shards: str, threads: int = 1) -> dict:
    """No loader: decode + random-resized-crop + flip -> uint8 of every train sample, twice, in one loop, or split
    over `threads` threads (what the decode alone allows in parallel on this machine)."""
    import threading

    import numpy as np

    from fastpipe.dataset.loading import load
    from fastpipe.loaders import cpu_ops
    from fastpipe.loaders.epoch import Piece
    from fastpipe.loaders.shards import ShardSet

    s = ShardSet(load(shards), "train")
    datas = [x.image for i, n in enumerate(s.counts) for x in s.read_piece(Piece(i, 0, n))]

    def loop(part, seed):
        rng, out = np.random.default_rng(seed), np.empty((224, 224, 3), np.uint8)
        for d in part:
            cpu_ops.decode_train(d, 224, rng, out=out)

    loop(datas[:20], 0)
    parts = [threading.Thread(target=loop, args=((datas * 2)[k::threads], k)) for k in range(threads)]
    t = time.perf_counter()
    for p in parts:
        p.start()
    for p in parts:
        p.join()
    return {"img_per_s": 2 * len(datas) / (time.perf_counter() - t)}


def python_step(ms: float) -> None:
    """A training step's stand-in that holds the GIL throughout: pure Python, no call that releases it."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def thread_accounts():
    """Each loader thread's (CPU seconds, seconds alive), recorded as its plan ends: what the threads' time went to."""
    from fastpipe.loaders.threads import LoaderThreads

    accounts, run = [], LoaderThreads._run

    def counted(self, w):
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return run(self, w)
        finally:
            accounts.append((time.thread_time() - cpu, time.perf_counter() - t))

    LoaderThreads._run = counted
    return accounts


def run_loader(shards: str, threads, args) -> dict:
    import torch

    from fastpipe import make_loader

    torch.set_num_threads(1)  # the training process only hands batches on here
    accounts = thread_accounts()
    base = anonymous(os.getpid())
    t = time.perf_counter()
    loader = make_loader(shards, "torch", batch_size=64, image_size=224, num_workers=args.workers, threads=threads,
                         cpu_decoder=args.decoder, device="cpu", normalize=False)

    def epoch(e):
        loader.set_epoch(e)
        n = 0
        for x, _ in loader:
            python_step(args.python_ms)
            n += len(x)
        return n

    first = epoch(0)
    first_s = time.perf_counter() - t
    accounts.clear()
    n, t = 0, time.perf_counter()
    for e in range(1, args.epochs + 1):
        n += epoch(e)
    wall = time.perf_counter() - t
    cpu, alive = sum(a[0] for a in accounts), sum(a[1] for a in accounts)
    loader.set_epoch(args.epochs + 1)  # an untimed epoch, measured half-way (reading smaps takes a while)
    for i, _ in enumerate(loader):
        if i == len(loader) // 2:
            mem = memory(base)
    assert loader.describe()["workers_are"] == WORKERS_ARE[threads]
    loader.close()
    # threads: shares of the threads' time (workers x wall) on a CPU, waiting while alive (the GIL, a full queue),
    # and ended before the epoch (a thread with fewer batches left, at each epoch's end)
    whole = args.workers * wall
    share = {"thread_cpu_share": cpu / whole, "thread_wait_share": (alive - cpu) / whole,
             "thread_ended_share": 1 - alive / whole} if threads is True else {}
    return {"img_per_s": n / wall, "first_epoch_s": first_s, "first_epoch_images": first, **mem, **share}


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def own_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one(variant: str, shards: str, args) -> dict:
    """One run, with the cores other processes took meanwhile (the machine's busy time less this run's)."""
    busy, own, t = busy_seconds(), own_seconds(), time.perf_counter()
    if variant in (BOUND, BARE_THREADS):
        res = run_bound(shards, 1 if variant == BOUND else args.workers)
    else:
        res = run_loader(shards, MODES[variant], args)
    others = (busy_seconds() - busy) - (own_seconds() - own)
    return {**res, "load_avg_1min": os.getloadavg()[0], "others_cores": max(others, 0) / (time.perf_counter() - t)}


def settle(limit: float) -> None:
    """Wait, at most `limit` seconds, for a second in which other processes used under 0.2 cores (on a shared
    machine: rounds then start when it is quiet; each run still records what others took)."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        busy, own = busy_seconds(), own_seconds()
        time.sleep(1)
        if (busy_seconds() - busy) - (own_seconds() - own) < 0.2:
            return


def fresh(variant: str, shards: Path, args) -> dict:
    from fastpipe.bench.timing import run_fresh

    return run_fresh([__file__, "--one", variant, str(shards), "--workers", str(args.workers), "--decoder",
                      args.decoder, "--epochs", str(args.epochs), "--python-ms", str(args.python_ms)], variant)


def report(runs: dict, args, samples: int) -> dict:
    from fastpipe.bench.timing import spread

    p, t, b, bare = runs["processes"], runs["threads"], runs[BOUND], runs[BARE_THREADS]

    def paired(f):
        return spread([f(x, y, z) for x, y, z in zip(p, t, b)])

    fields = ("img_per_s", "first_epoch_s", "uss_bytes", "pss_bytes", "main_uss_bytes", "workers_uss_bytes",
              "shm_bytes")
    threads = {f: spread([r[f] for r in t]) for f in ("thread_cpu_share", "thread_wait_share", "thread_ended_share")}
    return {"workers": args.workers, "rounds": args.rounds, "train_samples": samples, "decoder": args.decoder,
            "epochs": args.epochs, "python_ms_per_batch": args.python_ms, "threads_time": threads,
            "bound_img_per_s": spread([z["img_per_s"] for z in b]),
            "bare_threads_img_per_s": spread([z["img_per_s"] for z in bare]),
            "bare_threads_vs_bound": spread([x["img_per_s"] / (args.workers * z["img_per_s"])
                                             for x, z in zip(bare, b)]),
            "threads_vs_bare_threads": spread([y["img_per_s"] / x["img_per_s"] for x, y in zip(bare, t)]),
            "modes": {m: {f: spread([r[f] for r in runs[m]]) for f in fields} for m in MODES},
            "threads_over_processes": paired(lambda x, y, z: y["img_per_s"] / x["img_per_s"]),
            "threads_vs_bound": paired(lambda x, y, z: y["img_per_s"] / (args.workers * z["img_per_s"])),
            "processes_vs_bound": paired(lambda x, y, z: x["img_per_s"] / (args.workers * z["img_per_s"])),
            "first_epoch_processes_over_threads": paired(lambda x, y, z: x["first_epoch_s"] / y["first_epoch_s"]),
            "uss_threads_over_processes": paired(lambda x, y, z: y["uss_bytes"] / x["uss_bytes"]),
            "pss_threads_over_processes": paired(lambda x, y, z: y["pss_bytes"] / x["pss_bytes"]),
            # what the loader adds to the machine: anonymous memory (PSS) and the /dev/shm it maps
            "memory_threads_over_processes": paired(lambda x, y, z: (y["pss_bytes"] + y["shm_bytes"])
                                                    / (x["pss_bytes"] + x["shm_bytes"])),
            "helper_over_threads": spread([h["img_per_s"] / y["img_per_s"] for h, y in zip(runs["helper"], t)]),
            "memory_helper_over_processes": spread([(h["pss_bytes"] + h["shm_bytes"])
                                                    / (x["pss_bytes"] + x["shm_bytes"])
                                                    for h, x in zip(runs["helper"], p)]),
            "load_avg_1min": [r["load_avg_1min"] for v in runs.values() for r in v],
            "others_cores": spread([r["others_cores"] for v in runs.values() for r in v])}


def _r(v: dict, fmt: str = ".2f", scale: float = 1) -> str:
    return f"{v['median'] / scale:{fmt}} ({v['low'] / scale:{fmt}}-{v['high'] / scale:{fmt}})"


def table(res: dict) -> str:
    mb = 2**20
    lines = [f"{res['train_samples']} samples, {res['workers']} workers, decoder {res['decoder']}, "
             f"{res['python_ms_per_batch']} ms of pure Python per batch in the training process, {res['rounds']} "
             f"rounds (median, range); load average {min(res['load_avg_1min']):.1f}-{max(res['load_avg_1min']):.1f}, "
             f"cores other processes took during a run {_r(res['others_cores'])}",
             f"  one-process decode bound {_r(res['bound_img_per_s'], ',.0f')} img/s; the same loop in "
             f"{res['workers']} threads {_r(res['bare_threads_img_per_s'], ',.0f')} img/s, ÷ (workers x bound) "
             f"{_r(res['bare_threads_vs_bound'])}; the thread mode ÷ it {_r(res['threads_vs_bare_threads'])}"]
    for m, v in res["modes"].items():
        lines.append(f"  {m:<10} {_r(v['img_per_s'], ',.0f')} img/s; first epoch {_r(v['first_epoch_s'])} s; "
                     f"USS {_r(v['uss_bytes'], ',.0f', mb)} MB (training process {_r(v['main_uss_bytes'], ',.0f', mb)}"
                     f", workers {_r(v['workers_uss_bytes'], ',.0f', mb)}); PSS {_r(v['pss_bytes'], ',.0f', mb)} MB; "
                     f"/dev/shm {_r(v['shm_bytes'], ',.1f', mb)} MB")
    tt = res["threads_time"]
    lines += [f"  the threads' time: on a CPU {_r(tt['thread_cpu_share'])}, waiting {_r(tt['thread_wait_share'])}, "
              f"ended before the epoch {_r(tt['thread_ended_share'])}"]
    lines += [f"  threads / processes {_r(res['threads_over_processes'])}; threads / (workers x bound) "
              f"{_r(res['threads_vs_bound'])}, processes {_r(res['processes_vs_bound'])}; first epoch, processes / "
              f"threads {_r(res['first_epoch_processes_over_threads'])}; USS threads / processes "
              f"{_r(res['uss_threads_over_processes'])}, PSS {_r(res['pss_threads_over_processes'])}, PSS + /dev/shm "
              f"{_r(res['memory_threads_over_processes'])}",
              f"  helper / threads {_r(res['helper_over_threads'])}; memory (PSS + /dev/shm), helper / processes "
              f"{_r(res['memory_helper_over_processes'])}"]
    return "\n".join(lines)


def main(args) -> dict:
    from fastpipe.dataset.loading import load

    base = Path(tempfile.mkdtemp(prefix="fp-workers-"))
    try:
        shards = Path(args.shards) if args.shards else make_shards(args, base)
        runs: dict[str, list] = {k: [] for k in (*MODES, BOUND, BARE_THREADS)}
        rng = random.Random(0)
        for r in range(args.rounds):
            order = list(runs)
            rng.shuffle(order)
            settle(args.settle)
            for name in order:
                runs[name].append(fresh(name, shards, args))
            print(f"  round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f})", flush=True)
        return report(runs, args, load(shards).splits["train"].samples)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    a = parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a)))
        sys.exit(0)
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))

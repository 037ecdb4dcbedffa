"""The cost of converting on Ray: the same `fastpipe shard` on one machine (N worker processes) and on a local Ray
cluster of the same N CPUs, interleaved, at two collection sizes.

    python benchmarks/bench_ray.py --sizes 200,400 --cpus 2 --rounds 5 --json docs/results/ray.json

Demo photos (8 megapixels, `fastpipe demo-data`) unless --raw; the smaller collection is the first photos of the
larger (hard links). A Ray cluster of one node with --cpus CPUs is started once, by this script, and each Ray run joins
it (`--ray-address`), as a job on an existing cluster does. Every run is a fresh Python process (glibc's allocator and
forked workers inherit what a process did before); each round runs every variant once, in a shuffled order, so that
drift in the machine's speed hits all alike. Reported: the median over rounds with its range, of the whole call and
of its phases (start: joining the cluster or starting the pool; hash: reading and hashing every photo, on the cluster
for Ray; convert; finish: rejections, previews, manifest); and Ray's extra time split into what each photo costs and
what each job costs, from the two sizes, paired by round: per photo = the growth of (Ray - one machine) from the
smaller to the larger collection, divided by the photos added; per job = the rest. The same split for CPU time: the
machine's busy CPU seconds during the call (all processes; Linux), and of those, Ray's own processes' (raylet, GCS,
agents: what a Ray node runs besides the tasks, not its worker processes). The benchmark's cluster idles beside the
one-machine runs: its CPU time is taken out of theirs (recorded as idle_cluster_cpu_s), its share of their wall time
cannot be. Before each run the machine is let settle (under 0.1 CPU busy for a second, at most 20 s). Every pair of
outputs is compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fastpipe.bench.timing import run_fresh, spread

KINDS = ("one machine", "ray")
MACHINE = "2-core x86-64 cloud VM, no GPU"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", help="class folders of photos (default: demo photos, generated)")
    ap.add_argument("--sizes", default="200,400", help="two collection sizes (photos)")
    ap.add_argument("--cpus", type=int, default=2, help="worker processes on one machine = the Ray cluster's CPUs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench-results/ray.json")
    ap.add_argument("--one", nargs=4, metavar=("KIND", "RAW", "OUT", "ADDRESS"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores; Linux /proc/stat), 0 elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def ray_daemons_cpu_s() -> float:
    """CPU seconds used so far by Ray's own long-lived processes on this machine (raylet, GCS, agents, monitors), not
    its worker processes (they run the photos) nor this one."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ours = ("raylet" in cmd or "gcs_server" in cmd or "/ray/" in cmd) and "default_worker" not in cmd
        if ours and int(stat.parent.name) != os.getpid():
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def one(kind: str, raw: str, out: str, address: str, cpus: int) -> dict:
    """One conversion in this (fresh) process: its wall time and phases, the CPU time the machine spent in it, and
    the share of that used by Ray's own processes. A one-machine run has the benchmark's cluster idling beside it,
    which a user converting without Ray would not have: its processes' CPU time is taken out of the run's (and
    recorded apart); their share of the wall time cannot be, and is said in the results."""
    from fastpipe.convert.driver import ShardConfig, shard

    cpu, daemons, start = machine_cpu_s(), ray_daemons_cpu_s(), time.perf_counter()
    summary = shard(ShardConfig(raw, out, workers=cpus, ray_address=address if kind == "ray" else None))
    wall = time.perf_counter() - start
    cpu, daemons = machine_cpu_s() - cpu, ray_daemons_cpu_s() - daemons
    idle = daemons if kind == "one machine" else 0.0
    return {"wall_s": wall, "phases_s": dict(summary.phases), "files": summary.discovered,
            "cpu_s": cpu - idle, "ray_daemons_cpu_s": daemons - idle, "idle_cluster_cpu_s": idle,
            "notes": [n for n in summary.notes if "Ray" in n]}


def settle(most_s: float = 20.0, quiet_cpus: float = 0.1) -> None:
    """Wait (at most `most_s`) until the machine uses under `quiet_cpus` CPUs over a second: what a run leaves
    behind (Ray ending the job's worker processes and starting idle ones) is not charged to the next run."""
    end = time.monotonic() + most_s
    while time.monotonic() < end:
        before = machine_cpu_s()
        time.sleep(1.0)
        if machine_cpu_s() - before < quiet_cpus:
            return


def subset(raw: Path, n: int, folder: Path) -> Path:
    """The first `n` files of `raw` (sorted by path), hard-linked into `folder` with their class folders."""
    for f in sorted(p for p in raw.rglob("*") if p.is_file())[:n]:
        (folder / f.relative_to(raw)).parent.mkdir(parents=True, exist_ok=True)
        os.link(f, folder / f.relative_to(raw))
    return folder


def outputs_equal(a: Path, b: Path) -> bool:
    files = [p.relative_to(a) for p in sorted(a.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    return bool(files) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def measure(args, sets: dict[int, Path], tmp: Path, address: str) -> dict:
    rng, same = random.Random(0), []
    runs: dict = {(n, k): [] for n in sets for k in KINDS}
    for r in range(args.rounds):
        outs = {}
        for n, kind in rng.sample(list(runs), len(runs)):
            outs[n, kind] = tmp / f"{r}-{n}-{kind.replace(' ', '-')}"
            settle()
            runs[n, kind].append(run_fresh([__file__, "--cpus", str(args.cpus), "--one", kind, str(sets[n]),
                                            str(outs[n, kind]), address], f"the {kind} run"))
        same += [outputs_equal(outs[n, "one machine"], outs[n, "ray"]) for n in sets]
        for out in outs.values():
            shutil.rmtree(out)
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {k} {v[-1]['wall_s']:.2f} s"
                                                            for (n, k), v in runs.items()), flush=True)
    return summarise(runs, same)


def summarise(runs: dict, same: list[bool]) -> dict:
    small, large = sorted({n for n, _ in runs})
    phases = list(runs[large, "ray"][0]["phases_s"])

    def get(x: dict, what: str) -> float:
        named = {"whole call": x["wall_s"], "CPU": x["cpu_s"], "Ray's own processes' CPU": x["ray_daemons_cpu_s"]}
        return named[what] if what in named else x["phases_s"][what]

    def extra(n: int, what: str) -> list[float]:  # Ray's seconds less one machine's, per round
        return [get(b, what) - get(a, what) for a, b in zip(runs[n, "one machine"], runs[n, "ray"])]

    variants = {f"{n} {k}": {"files": v[0]["files"], "wall_s": spread([x["wall_s"] for x in v]),
                             "cpu_s": spread([x["cpu_s"] for x in v]),
                             "ray_daemons_cpu_s": spread([x["ray_daemons_cpu_s"] for x in v]),
                             "idle_cluster_cpu_s": spread([x["idle_cluster_cpu_s"] for x in v]),
                             "phases_s": {p: spread([x["phases_s"][p] for x in v]) for p in phases}}
                for (n, k), v in runs.items()}
    added = runs[large, "ray"][0]["files"] - runs[small, "ray"][0]["files"]
    split, share = {}, {}
    for what in ("whole call", *phases, "CPU", "Ray's own processes' CPU"):
        per_photo = [(b - a) / added for a, b in zip(extra(small, what), extra(large, what))]
        if what in ("whole call", "CPU"):  # Ray's extra per photo against one machine's per photo, paired by round
            base = [(get(b, what) - get(a, what)) / added for a, b in
                    zip(runs[small, "one machine"], runs[large, "one machine"])]
            share[what] = spread([x / y for x, y in zip(per_photo, base)])
        split[what] = {"ms_per_photo": spread([x * 1e3 for x in per_photo]),
                       "s_per_job": spread([a - x * runs[small, "ray"][0]["files"]
                                            for a, x in zip(extra(small, what), per_photo)])}
    one_photo = spread([(b["wall_s"] - a["wall_s"]) / added * 1e3 for a, b in
                        zip(runs[small, "one machine"], runs[large, "one machine"])])
    one_photo_cpu = spread([(b["cpu_s"] - a["cpu_s"]) / added * 1e3 for a, b in
                            zip(runs[small, "one machine"], runs[large, "one machine"])])
    ratio = {f"{n} {what}": spread([(b["wall_s"] if what == "whole call" else b["phases_s"]["convert"])
                                    / (a["wall_s"] if what == "whole call" else a["phases_s"]["convert"])
                                    for a, b in zip(runs[n, "one machine"], runs[n, "ray"])])
             for n in (small, large) for what in ("whole call", "convert phase")}
    return {"variants": variants, "ray_extra": split, "ray_extra_per_photo_share": share,
            "one_machine_ms_per_photo": one_photo,
            "one_machine_cpu_ms_per_photo": one_photo_cpu,
            "ray_over_one_machine": ratio, "outputs_byte_identical": all(same),
            "ray_notes": runs[large, "ray"][-1]["notes"]}


def table(res: dict) -> str:
    def r(s, f=".2f"):
        return f"{s['median']:{f}} ({s['low']:{f}}-{s['high']:{f}})"

    lines = [f"{res['cpus']} CPUs, {res['rounds']} rounds (median, range)"]
    for name, v in res["variants"].items():
        lines.append(f"{name:18s} {v['files']} files  {r(v['wall_s'])} s  CPU {r(v['cpu_s'])} s  "
                     + "  ".join(f"{p} {r(s)}" for p, s in v["phases_s"].items()))
    lines.append(f"one machine: {r(res['one_machine_ms_per_photo'])} ms per photo, "
                 f"{r(res['one_machine_cpu_ms_per_photo'])} CPU ms per photo (the growth between the sizes)")
    lines += [f"the idle cluster beside the one-machine runs: {r(v['idle_cluster_cpu_s'])} CPU s at {name}"
              for name, v in res["variants"].items() if "one machine" in name]
    lines += [f"Ray's extra, {what}: {r(x['ms_per_photo'])} ms per photo + {r(x['s_per_job'])} s per job"
              for what, x in res["ray_extra"].items()]
    lines += [f"Ray's extra per photo / one machine's, {k}: {r(v, '.3f')}"
              for k, v in res["ray_extra_per_photo_share"].items()]
    lines += [f"Ray / one machine, {k}: {r(v, '.3f')}" for k, v in res["ray_over_one_machine"].items()]
    lines.append(f"outputs byte-identical: {res['outputs_byte_identical']}")
    return "\n".join(lines)


def main(args) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from fastpipe.convert.demo import DemoConfig, make_demo_data

    sizes = sorted(int(x) for x in args.sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="fp-bench-ray-") as tmp:
        raw = Path(args.raw) if args.raw else Path(tmp) / "raw"
        if not args.raw:
            make_demo_data(DemoConfig(raw, count=sizes[-1]))
        sets = {n: subset(raw, n, Path(tmp) / f"raw-{n}") for n in sizes}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus})
        try:
            res = measure(args, sets, Path(tmp), cluster.address)
        finally:
            cluster.shutdown()
    return res | {"benchmark": "ray", "cpus": args.cpus, "rounds": args.rounds, "ray": ray.__version__,
                  "machine": {"kind": MACHINE, "cpus": os.cpu_count(), "platform": platform.platform()},
                  "command": "python benchmarks/bench_ray.py " + " ".join(sys.argv[1:])}


if __name__ == "__main__":
    a = parse_args()
    if a.one:
        print(json.dumps(one(*a.one, a.cpus)))
        sys.exit(0)
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"json: {a.json}")

"""Indexing foreign shards where they are (`fastpipe index URL/*.tar --out FOLDER`): the bytes fetched and the time
taken, against downloading the same shards whole, from a loopback server that answers the Hugging Face Hub's API
with a fixed latency added to every request (a store's time to first byte).

    python benchmarks/bench_adopt.py --latency 0.02 --json docs/results/adopt.json

The shards are timm-style (.jpg, .cls, .json per sample), their photos noise-filled JPEGs of about the size of an
ImageNet photo (500 x 375 at quality 90: ~175 KB; real photos compress better, which makes the header walk's share
of the bytes larger, not its number of requests). The walk makes one request per sample (its label, metadata and
the next header come together), the shards walked AT_ONCE at a time; its time is about samples / AT_ONCE x latency
plus the photos fetched for mean/std and the previews. Each variant runs `--rounds` times, alternated. The server
runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--latency", type=float, default=0.02, help="seconds added to every request")
    ap.add_argument("--stats-samples", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="bench-results/adopt.json")
    return ap.parse_args(argv)


def serve(folder: str, latency: float, ready) -> None:
    """The Hub, in a process of its own (in this one, its Python would compete with the client's for the GIL)."""
    from fastpipe.testing.hubserver import Hub, serve_hub

    hub = Hub(latency=latency)
    hub.create("timm/bench-wds", {p.name: p.read_bytes() for p in sorted(Path(folder).glob("*.tar"))})
    ready.put(serve_hub(hub)[1])
    time.sleep(1e6)


def requests(endpoint: str) -> list[dict]:
    import urllib.request

    with urllib.request.urlopen(f"{endpoint}/_requests") as r:
        return json.loads(r.read())


IMAGENET_1K = 1_281_167  # training samples: the walk's time projected to timm's imagenet-1k-wds at this rate


def _cpu() -> float:
    """This process's CPU seconds, every thread's, user and system."""
    t = os.times()
    return t.user + t.system


def main(args) -> dict:
    import multiprocessing

    from fastpipe.cli import main as cli
    from fastpipe.store.remote import Remote
    from fastpipe.testing.wds import timm_style_shards

    base = Path(tempfile.mkdtemp(prefix="fp-adopt-"))
    paths = timm_style_shards(base / "local", args.shards, args.per_shard, side=(375, 500), classes=10,
                              show_class=False)
    ready = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(str(base / "local"), args.latency,
                                                                               ready), daemon=True)
    server.start()
    endpoint = ready.get(timeout=120)
    os.environ.update(HF_ENDPOINT=endpoint, HF_HOME=str(base / "hf"), FASTPIPE_CACHE=str(base / "cache"))
    try:
        total = sum(p.stat().st_size for p in paths)
        urls = [f"hf://datasets/timm/bench-wds/{p.name}" for p in paths]
        runs = {"walk": [], "download": []}
        for r in range(args.rounds):
            before, t, cpu = len(requests(endpoint)), time.perf_counter(), _cpu()
            out = base / f"idx-{r}"
            assert cli(["index", *urls, "--out", str(out), "--stats-samples", str(args.stats_samples)]) == 0
            seconds, cpu = time.perf_counter() - t, _cpu() - cpu
            reads = [q["sent"] for q in requests(endpoint)[before:] if q["path"].endswith(".tar")]
            runs["walk"].append({"s": seconds, "requests": len(reads), "bytes": sum(reads),
                                 "client_cpu_ms_per_request": 1000 * cpu / max(1, len(reads))})
            t = time.perf_counter()
            Remote("hf://datasets/timm/bench-wds").get_many([(p.name, base / f"dl-{p.name}") for p in paths])
            runs["download"].append({"s": time.perf_counter() - t, "bytes": total})
            for p in paths:
                (base / f"dl-{p.name}").unlink()
        samples = args.shards * args.per_shard
        med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
        return {"shards": args.shards, "samples": samples, "shard_bytes": total, "latency_s": args.latency,
                "stats_samples": args.stats_samples, "rounds": args.rounds, "runs": runs, "median": med,
                "walk_bytes_share": med["walk"]["bytes"] / total,
                "walk_requests_per_sample": med["walk"]["requests"] / samples,
                "walk_seconds_per_1000_samples": 1000 * med["walk"]["s"] / samples,
                "imagenet_1k_walk_minutes": IMAGENET_1K * med["walk"]["s"] / samples / 60}
    finally:
        server.kill()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    a = parse_args()
    res = main(a)
    m = res["median"]
    print(f"{res['samples']} samples in {res['shards']} shards ({res['shard_bytes'] / 2**20:.0f} MB), "
          f"{res['latency_s'] * 1000:.0f} ms a request, {res['rounds']} rounds (medians):")
    print(f"  header walk: {m['walk']['s']:.2f} s, {m['walk']['requests']:.0f} requests "
          f"({res['walk_requests_per_sample']:.2f} a sample), {m['walk']['bytes'] / 2**20:.1f} MB "
          f"({100 * res['walk_bytes_share']:.1f} % of the shards); {res['walk_seconds_per_1000_samples']:.2f} s per "
          f"1000 samples; {m['walk']['client_cpu_ms_per_request']:.1f} ms of this process's CPU a request; "
          f"ImageNet-1k's training set at this rate: {res['imagenet_1k_walk_minutes']:.0f} minutes")
    print(f"  whole download: {m['download']['s']:.2f} s, {m['download']['bytes'] / 2**20:.0f} MB")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    sys.exit(0)

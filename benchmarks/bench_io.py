"""Three I/O paths, each against the obvious alternative, interleaved in one run (medians with ranges):

- reading a photo: `util.read_regular` (the file's size plus one byte) against `read(limit + 1)`, which allocates
  a buffer of the 1 GB limit for every file (hashing and converting both read every photo);
- range requests to a store: `Remote.ranges` (one `cat_ranges` call on the client's event loop) against a thread
  per request, over loopback HTTP (fastpipe.testing.devserver in its own process), CPU seconds of this process per
  100 MB;
- a tar member's header, as the converter writes 3 to 4 per image: `shardformat.tar_header` against tarfile's
  `TarInfo.tobuf` (the same bytes), µs per header.

    python benchmarks/bench_io.py --photos RAW_FOLDER --shards CONVERTED_SET --json bench-results/io.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastpipe.bench.timing import spread
from fastpipe.dataset.shardformat import tar_header
from fastpipe.store.remote import Remote
from fastpipe.util import read_regular

LIMIT = 1024**3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", required=True, help="a folder of image files")
    ap.add_argument("--shards", required=True, help="a converted data set (its train .tar files are served)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench-results/io.json")
    return ap.parse_args(argv)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def read_whole_limit(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(LIMIT + 1)


def per_file_us(files: list[Path], read) -> float:
    t = time.perf_counter()
    for f in files:
        read(f)
    return (time.perf_counter() - t) / len(files) * 1e6


def thread_per_request(remote: Remote, parts) -> None:
    fs, root, _ = remote._client()
    with ThreadPoolExecutor(remote.inflight) as pool:
        list(pool.map(lambda p: fs.cat_file(f"{root}/{p[0]}", start=p[1], end=p[2]), parts))


def ranges_cpu_per_100mb(url: str, parts, batched: bool) -> float:
    remote = Remote(url)
    remote.cat("dataset.json")  # the client and its connections made outside the timing
    c = cpu()
    for k in range(0, len(parts), 16):  # as the cache fetches: a window's coalesced ranges at a time
        remote.ranges(parts[k:k + 16]) if batched else thread_per_request(remote, parts[k:k + 16])
    return (cpu() - c) / (sum(e - s for _, s, e in parts) / 1e8)


def tarfile_header(name: str, size: int) -> bytes:
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8")


def header_us(make, n: int = 20_000) -> float:
    t = time.perf_counter()
    for k in range(n):
        make(f"{k:08d}.jpg", 15_000 + k)
    return (time.perf_counter() - t) / n * 1e6


def main(args) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_remote import served

    files = sorted(p for p in Path(args.photos).rglob("*") if p.is_file())
    tars = sorted(Path(args.shards).glob("train*.tar"))
    parts = [(t.name, s, min(t.stat().st_size, s + 400_000)) for t in tars for s in range(0, t.stat().st_size, 400_000)]
    runs: dict[str, list[float]] = {k: [] for k in ("read_regular_us", "read_limit_us", "ranges_batched_cpu_s",
                                                      "ranges_thread_per_request_cpu_s", "tar_header_us",
                                                      "tarfile_header_us")}
    with served(Path(args.shards), 0) as (url, _):
        for r in range(args.rounds):
            runs["read_regular_us"].append(per_file_us(files, lambda f: read_regular(f, LIMIT)))
            runs["read_limit_us"].append(per_file_us(files, read_whole_limit))
            runs["ranges_batched_cpu_s"].append(ranges_cpu_per_100mb(url, parts, True))
            runs["ranges_thread_per_request_cpu_s"].append(ranges_cpu_per_100mb(url, parts, False))
            runs["tar_header_us"].append(header_us(tar_header))
            runs["tarfile_header_us"].append(header_us(tarfile_header))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in runs.items()), flush=True)
    result = {"files": len(files), "mb_per_file": sum(f.stat().st_size for f in files) / len(files) / 1e6,
              "range_parts": len(parts), "cpus": os.cpu_count(), **{k: spread(v) for k, v in runs.items()}}
    print(json.dumps(result, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(parse_args())

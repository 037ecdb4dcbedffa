"""The naive baseline vs fastpipe: torchvision ImageFolder on the raw high-resolution photos with
Resize((224, 224)) + ToTensor + Normalize, against fastpipe's torch backend on the converted shards, with the
same workers and batch; and the one-time conversion cost amortised over 10 epochs.

    python benchmarks/bench_naive.py --photos 160 --workers 2 --json bench-results/naive.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from fastpipe import make_loader
from fastpipe.bench.timing import endless, measure
from fastpipe.convert.demo import DemoConfig, make_demo_data
from fastpipe.convert.driver import ShardConfig, shard


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=160)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=10, help="epochs over which the conversion is amortised")
    ap.add_argument("--json", default="bench-results/naive.json")
    return ap.parse_args(argv)


def naive_loader(raw: Path, args):
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    tf = T.Compose([T.Resize((args.image_size, args.image_size)), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    return torch.utils.data.DataLoader(ImageFolder(str(raw), transform=tf), batch_size=args.batch_size, shuffle=True,
                                       num_workers=args.workers, persistent_workers=True, drop_last=True)


def rate(loader, window: int) -> float:
    it = endless(lambda e: (loader.set_epoch(e), loader)[1] if hasattr(loader, "set_epoch") else loader)

    def step():
        return len(next(it)[1])

    return measure(step, warmup=1, windows=3, window_images=window).img_per_s


def main(args) -> dict:
    base = Path(tempfile.mkdtemp(prefix="fp-naive-"))
    try:
        raw, out = base / "raw", base / "shards"
        make_demo_data(DemoConfig(raw, count=args.photos))
        start = time.perf_counter()
        summary = shard(ShardConfig(raw, out, max_shard_size=8 * 2**20))
        convert_s = time.perf_counter() - start
        # ImageFolder stops at the first broken file; remove what the converter rejected (it found them).
        for line in (out / "rejected.jsonl").read_text().splitlines():
            (raw / json.loads(line)["path"]).unlink(missing_ok=True)
        naive = rate(naive_loader(raw, args), window=64)
        fast = rate(make_loader(out, "torch", batch_size=args.batch_size, image_size=args.image_size,
                                num_workers=args.workers, device="cpu"), window=1024)
        n = summary.written["train"] + summary.written.get("val", 0)
        amortised = args.epochs * n / (convert_s + args.epochs * n / fast)
        result = {"benchmark": "naive-vs-fastpipe", "machine": {"cpus": os.cpu_count(),
                                                                  "platform": platform.platform()},
                  "settings": vars(args), "photos": n, "naive_img_per_s": naive, "fastpipe_img_per_s": fast,
                  "speedup": fast / naive, "conversion_seconds": convert_s,
                  "fastpipe_amortised_img_per_s": amortised, "amortised_speedup": amortised / naive,
                  "rejected_by_converter": dict(summary.rejected)}
        print(f"naive ImageFolder on {n} raw 3264x2448 photos: {naive:8.1f} img/s")
        print(f"fastpipe torch backend on the shards:           {fast:8.1f} img/s  ({fast / naive:.0f}x)")
        print(f"one-time conversion: {convert_s:.1f} s; over {args.epochs} epochs fastpipe averages "
              f"{amortised:.1f} img/s ({amortised / naive:.1f}x the naive pipeline)")
        print(f"(the naive pipeline crashes on the broken files the converter rejected: {dict(summary.rejected)})")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(parse_args())

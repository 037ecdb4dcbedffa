"""End-to-end training images/s for resnet18 and resnet50 with each loader backend (fastpipe bench's three
measurements per combination), on the device the script runs on (CUDA when available, else the CPU).

    python benchmarks/bench_e2e.py --shards OUT --json bench-results/e2e.json --plot bench-results/e2e.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fastpipe.bench.harness import BenchConfig, run_sweep
from fastpipe.bench.report import plot, table


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", required=True, help="a converted data set")
    ap.add_argument("--models", default="resnet18,resnet50")
    ap.add_argument("--backends", default="torch,nvjpeg,dali")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 128 on CUDA, 16 on CPU")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per window (default: 20 CUDA, 2 CPU)")
    ap.add_argument("--json", default="bench-results/e2e.json")
    ap.add_argument("--plot", default="bench-results/e2e.png")
    return ap.parse_args(argv)


def main(args) -> dict:
    cuda = args.device.startswith("cuda")
    out = {"models": {}}
    for model in args.models.split(","):
        cfg = BenchConfig(args.shards, model=model, device=args.device, image_size=args.image_size,
                          batch_size=args.batch_size or (128 if cuda else 16), workers=args.workers,
                          steps=args.steps or (20 if cuda else 2), windows=3 if cuda else 2, warmup=3 if cuda else 1)
        result = run_sweep(cfg, {"backend": args.backends.split(",")})
        print(f"\n== {model}\n{table(result)}")
        out["models"][model] = result
        if args.plot:
            p = Path(args.plot)
            plot(result, str(p.with_name(f"{p.stem}-{model}{p.suffix}")))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main(parse_args())

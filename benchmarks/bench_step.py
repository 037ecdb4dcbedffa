"""The training loop's speed with each worker mode, not the loader's: steps/s of a loop whose stand-in training step
holds the GIL for G ms (the step's Python: kernel launches, optimizer bookkeeping, logging) and then releases it for
S ms (the device working: a sleep), for several G/S, the torch backend's loader feeding it.

    python benchmarks/bench_step.py --rounds 5 --json docs/results/step.json

One process holds a loader of every mode (the default, threads, processes, threads in a helper process), built
once (the default once per G/S: it looks at the training step's first epoch, the untimed warm-up one, to choose);
each round times one epoch of every mode for every G/S, in a shuffled order, so that drift in the machine's speed
hits all alike. Figures are medians over rounds with their ranges; "default / best, by round" is the median of
each round's default steps/s over the best mode's of that round (where modes are even, the best of several noisy
figures reads high, and this ratio low); "of the medians": the default's median over the best mode's median.
Work per image: decode + random-resized-crop + flip.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = {"default": None, "threads": True, "processes": False, "helper": "helper"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a converted data set (default: demo photos, generated and sharded)")
    ap.add_argument("--photos", type=int, default=1100, help="demo photos to generate without --shards")
    ap.add_argument("--short-side", type=int, default=320)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", default="5/10,2/20,1/5,3/0,8/0", help="G/S pairs: ms holding the GIL / releasing it")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench-results/step.json")
    return ap.parse_args(argv)


def step(held_ms: float, released_ms: float) -> None:
    """The stand-in: pure Python (no call that releases the GIL) for held_ms, then a sleep for released_ms."""
    end = time.perf_counter() + held_ms / 1000
    while time.perf_counter() < end:
        pass
    if released_ms:
        time.sleep(released_ms / 1000)


def epoch_rate(loader, epoch: int, held: float, released: float) -> float:
    loader.set_epoch(epoch)
    n, t = 0, time.perf_counter()
    for _ in loader:
        step(held, released)
        n += 1
    return n / (time.perf_counter() - t)


def measure(shards: str, args) -> dict:
    import torch

    from fastpipe import make_loader

    torch.set_num_threads(1)
    steps = [tuple(float(x) for x in s.split("/")) for s in args.steps.split(",")]
    modes = args.modes.split(",")
    def build(m):
        return make_loader(shards, "torch", batch_size=args.batch, image_size=args.image_size,
                           num_workers=args.workers, threads=MODES[m], device="cpu", normalize=False)

    # the fixed modes serve every G/S; the default, which looks at the training step's first epoch, one loader each
    fixed = {m: build(m) for m in modes if m != "default"}
    loaders = {(m, g, s): fixed.get(m) or build(m) for g, s in steps for m in modes}
    for (_, g, s), loader in loaders.items():
        epoch_rate(loader, 0, g, s)  # warm: workers started, files cached; the default's first look
    rates = {f"{g:g}/{s:g}": {m: [] for m in modes} for g, s in steps}
    rng, e = random.Random(0), 1
    for r in range(args.rounds):
        order = list(loaders)
        rng.shuffle(order)
        for m, g, s in order:
            rates[f"{g:g}/{s:g}"][m].append(epoch_rate(loaders[m, g, s], e, g, s))
            e += 1
        print(f"  round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f})", flush=True)
    described = {f"{m} {g:g}/{s:g}": loader.describe()["workers_are"] for (m, g, s), loader in loaders.items()}
    for loader in {id(v): v for v in loaders.values()}.values():
        loader.close()
    return {"rates": rates, "workers_are": described}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "low": min(xs), "high": max(xs)}


def report(measured: dict, args, samples: int) -> dict:
    rows = {}
    for gs, by_mode in measured["rates"].items():
        row = {m: spread(v) for m, v in by_mode.items()}
        if "default" in by_mode:
            rounds = range(len(by_mode["default"]))
            row["default_over_best"] = spread([by_mode["default"][i] / max(v[i] for v in by_mode.values())
                                               for i in rounds])
            # the same from the medians: each round's best of several noisy figures reads low where modes are even
            row["default_over_best_of_medians"] = row["default"]["median"] / max(
                row[m]["median"] for m in by_mode)
        rows[gs] = row
    return {"command": " ".join(["python", *sys.argv]), "train_samples": samples, "workers": args.workers,
            "batch": args.batch, "image_size": args.image_size, "short_side": args.short_side, "rounds": args.rounds,
            "workers_are": measured["workers_are"], "steps_per_s": rows, "rounds_steps_per_s": measured["rates"]}


def table(res: dict) -> str:
    modes = [m for m in MODES if m in next(iter(res["steps_per_s"].values()))]
    lines = [f"{res['train_samples']} samples, {res['workers']} workers, batch {res['batch']}, "
             f"{res['short_side']} -> {res['image_size']}, {res['rounds']} rounds: steps/s, median (range)",
             "| step: GIL held / released | " + " | ".join(modes) + " | default / best, by round | of the medians |",
             "|---" * (len(modes) + 3) + "|"]
    for gs, row in res["steps_per_s"].items():
        g, s = gs.split("/")
        cells = [f"{row[m]['median']:.1f} ({row[m]['low']:.1f}-{row[m]['high']:.1f})" for m in modes]
        best, medians = row.get("default_over_best"), row.get("default_over_best_of_medians")
        lines.append(f"| {g} ms / {s} ms | " + " | ".join(cells) + " | "
                     + (f"{best['median']:.2f} ({best['low']:.2f}-{best['high']:.2f}) | {medians:.2f}" if best
                        else "- | -") + " |")
    return "\n".join(lines)


def main(args) -> dict:
    from bench_workers import make_shards

    from fastpipe.dataset.loading import load

    base = Path(tempfile.mkdtemp(prefix="fp-step-"))
    try:
        shards = Path(args.shards) if args.shards else make_shards(args, base)
        return report(measure(str(shards), args), args, load(shards).splits["train"].samples)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    a = parse_args()
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")

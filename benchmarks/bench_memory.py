"""`fastpipe memory` against the GPU: predicted peak memory of one training step versus the measured one.

    python benchmarks/bench_memory.py [--models resnet18,resnet50,...] [--amp fp16,bf16,off] [--batch-sizes 64,256]
                                      --json bench-results/memory.json [--plot memory.png]

For each model × precision × batch it records three figures (MB):
- `measured`: peak `max_memory_allocated` of a real training step at that batch (after a warm-up step);
- `predicted_cuda`: what `fastpipe memory` says on that GPU (a line through two small measured batches, 4 and 12);
- `predicted_cpu`: what it says on a CPU (saved-tensor bytes, labelled there as a lower bound of the GPU figure).
Without CUDA only the CPU prediction is filled in (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from fastpipe.train.config import MemoryConfig
from fastpipe.train.memory import MB, analyse, cuda_peak


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,resnet50,efficientnet_b0,convnext_tiny,vit_b_16")
    ap.add_argument("--amp", default="fp16,bf16,off")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--json", default="bench-results/memory.json")
    ap.add_argument("--plot", default=None)
    return ap.parse_args(argv)


def measure(model: str, amp: str, batches: list[int], size: int) -> list[dict]:
    base = MemoryConfig(model=model, image_size=size, amp=amp, num_classes=1000, device="cpu")
    on_gpu = replace(base, device="cuda")
    cpu = analyse(base, techniques=False)
    gpu = analyse(on_gpu, techniques=False) if torch.cuda.is_available() else None
    rows = []
    for b in batches:
        row = {"model": model, "amp": amp, "batch": b, "predicted_cpu": cpu.total_mb(b),
               "predicted_cuda": gpu.total_mb(b) if gpu else None, "measured": None}
        if gpu:
            try:
                row["measured"] = cuda_peak(on_gpu, b, torch.device("cuda")) / MB
            except torch.OutOfMemoryError:
                row["measured"] = "out of memory"
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def error(row: dict, key: str) -> float | None:
    m = row["measured"]
    return (row[key] - m) / m if isinstance(m, float) and row[key] is not None else None


def _mb(v) -> str:
    return f"{v:,.0f} MB" if isinstance(v, float) else str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if isinstance(r["measured"], float)]
    fig, ax = plt.subplots(figsize=(6, 6))
    for key, marker in (("predicted_cuda", "o"), ("predicted_cpu", "x")):
        ax.scatter([r["measured"] for r in done], [r[key] for r in done], marker=marker, label=key)
    top = max([r["measured"] for r in done] + [1.0])
    ax.plot([0, top], [0, top], "k--", lw=1, label="exact")
    ax.set(xscale="log", yscale="log", xlabel="measured peak (MB)", ylabel="predicted (MB)",
           title=f"fastpipe memory vs measured ({torch.cuda.get_device_name() if done else 'no GPU'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    a = parse_args(argv)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    rows = []
    for model in a.models.split(","):
        for amp in a.amp.split(","):
            t = time.perf_counter()
            rows += measure(model, amp, batches, a.image_size)
            for r in rows[-len(batches):]:
                print(f"{model:16} {amp:5} b={r['batch']:<4} measured {_mb(r['measured'])}, predicted on the GPU "
                      f"{_mb(r['predicted_cuda'])} ({_pct(error(r, 'predicted_cuda'))}), on a CPU "
                      f"{_mb(r['predicted_cpu'])} ({_pct(error(r, 'predicted_cpu'))})  "
                      f"[{time.perf_counter() - t:.0f} s]", flush=True)
    for r in rows:
        r["error_cuda"], r["error_cpu"] = error(r, "predicted_cuda"), error(r, "predicted_cpu")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu only"
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    if a.plot:
        plot(rows, a.plot)
    print(f"json: {a.json}")


if __name__ == "__main__":
    main()

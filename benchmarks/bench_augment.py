"""What each device augmentation costs: the shared device step (uint8 batch → normalised float on the device) with
and without each augmentation, interleaved in one run, and the extra time as a share of one training step.

    python benchmarks/bench_augment.py [--device cuda] [--model resnet50] [--amp fp16] [--batch-size 256]
                                       [--rounds 5] --json bench-results/augment.json [--plot augment.png]

Each round times every variant once (so drift in the machine's speed hits all alike); the medians over rounds are
reported, with their range. `extra_ms` is a variant's step time minus the plain step's, `share_of_step` that extra
divided by one training step of the model (forward + backward + optimizer, synthetic data) at the same batch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from fastpipe.loaders.augment import DeviceAugment, parse
from fastpipe.loaders.base import DeviceStep

VARIANTS = ["none", "jitter:0.4:0.4:0.4", "jitter:0.4:0.4:0.4:0.1", "erase:0.25", "randaug:2:9", "trivialaug",
            "mixup:0.2", "cutmix:1.0", "mixup:0.8,cutmix:1.0", "randaug:2:9,erase:0.25,mixup:0.8,cutmix:1.0"]
CLASSES = 10


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="model whose step the cost is compared with (default: resnet50 "
                                                  "on a GPU, resnet18 on a CPU)")
    ap.add_argument("--amp", default=None, help="fp16, bf16 or off (default: fp16 on a GPU, off on a CPU)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 256 on a GPU, 32 on a CPU")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None, help="steps per variant per round (default: 10 GPU, 2 CPU)")
    ap.add_argument("--json", default="bench-results/augment.json")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    a.model = a.model or ("resnet50" if gpu else "resnet18")
    a.amp = a.amp or ("fp16" if gpu else "off")
    a.batch_size = a.batch_size or (256 if gpu else 32)
    a.steps = a.steps or (10 if gpu else 2)
    return a


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_steps(device: torch.device, batch: int, size: int) -> dict:
    """One callable per variant: the device step of a fixed uint8 batch, with the augmentation's draws keyed by a
    counter as the loaders key them by the batch's position."""
    x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=device)
    y = torch.randint(0, CLASSES, (batch,), device=device)
    steps, counter = {}, itertools.count()
    for name in VARIANTS:
        aug = None if name == "none" else DeviceAugment(parse(name), CLASSES, False, 0.1, 0)
        ds = DeviceStep(device, (0.5,) * 3, (0.25,) * 3, True, aug)

        def step(ds=ds):  # exactly what a loader does with a train batch once it is on the device
            host = ds.draw((0, next(counter), 0))
            return ds.mix(ds.images(x), ds.labels(y), host)

        steps[name] = step
    return steps


def model_step(device: torch.device, model_name: str, amp: str, batch: int, size: int):
    from fastpipe.train.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, CLASSES, size).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, CLASSES, (batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def timed(fn, device: torch.device, n: int) -> float:
    """Seconds per call, over n calls, the device's queue drained before and after."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / n


def run(a) -> dict:
    device = torch.device(a.device)
    steps = device_steps(device, a.batch_size, a.image_size)
    train = model_step(device, a.model, a.amp, a.batch_size, a.image_size)
    for fn in [*steps.values(), train]:  # warm-up: kernels compiled, allocator primed
        timed(fn, device, 1)
    times: dict[str, list[float]] = {k: [] for k in [*steps, "model"]}
    for r in range(a.rounds):
        for name, fn in steps.items():
            times[name].append(timed(fn, device, a.steps))
        times["model"].append(timed(train, device, max(1, a.steps // 2)))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name in steps:
        extra = med[name] - med["none"]
        rows.append({"augment": name, "step_ms": med[name] * 1e3, "range_ms": [min(times[name]) * 1e3,
                     max(times[name]) * 1e3], "img_per_s": a.batch_size / med[name], "extra_ms": extra * 1e3,
                     "share_of_step": extra / med["model"]})
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "model": a.model, "amp": a.amp, "batch_size": a.batch_size, "image_size": a.image_size,
            "rounds": a.rounds, "model_step_ms": med["model"] * 1e3, "model_img_per_s": a.batch_size / med["model"],
            "rows": rows}


def table(res: dict) -> str:
    lines = [f"{res['device']} {res['gpu'] or ''} · batch {res['batch_size']} × {res['image_size']} px · "
             f"{res['model']} {res['amp']} step {res['model_step_ms']:.1f} ms ({res['model_img_per_s']:,.0f} img/s)",
             f"{'augment':<45} {'device step':>12} {'img/s':>10} {'extra':>10} {'of a step':>10}"]
    for r in res["rows"]:
        lines.append(f"{r['augment']:<45} {r['step_ms']:>9.2f} ms {r['img_per_s']:>10,.0f} "
                     f"{r['extra_ms']:>7.2f} ms {r['share_of_step']:>10.1%}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a script, not the library: choosing the backend here changes nobody's process
    import matplotlib.pyplot as plt

    rows = res["rows"][1:]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh([r["augment"] for r in rows], [100 * r["share_of_step"] for r in rows], color="#4c72b0")
    ax.axvline(5, color="#c44e52", ls="--", lw=1, label="5 % target")
    ax.invert_yaxis()
    ax.set_xlabel(f"extra time, % of one {res['model']} {res['amp']} step at batch {res['batch_size']}")
    ax.set_title(f"Device augmentation cost on {res['gpu'] or res['device']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    a = parse_args(argv)
    res = run(a)
    print(table(res))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()

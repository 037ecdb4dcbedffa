"""Command line: argparse subcommands → config dataclasses → the functions that do the work. Nothing else."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from fastpipe import __version__

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2, "G": 1024**3, "GB": 1024**3}


def parse_size(text: str) -> int:
    """'256MB', '64k', '1.5G', '1000000' → bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper().replace("IB", "B") if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 256MB, 64KB, 2GB")
    return int(float(m.group(1)) * _UNITS[unit])


def _cmd_demo_data(a) -> int:
    from fastpipe.demo import DemoConfig, make_demo_data

    counts = make_demo_data(DemoConfig(Path(a.out), a.count, a.width, a.height, a.seed, a.workers))
    print(f"wrote {sum(counts.values())} photos to {a.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def _cmd_shard(a) -> int:
    from fastpipe.convert.driver import ShardConfig, shard

    cfg = ShardConfig(Path(a.src), Path(a.out), a.short_side, a.quality, a.val_fraction, a.seed,
                      a.max_shard_size, a.max_pixels, a.workers, a.overwrite, a.part, a.parts)
    summary = shard(cfg)
    print("\n".join(summary.lines()))
    if cfg.parts > 1:
        print(f"part {cfg.part} of {cfg.parts} done; when all parts are: fastpipe merge {cfg.out}")
    else:
        print(f"manifest: {cfg.out / 'dataset.json'}   previews: {cfg.out / 'previews'}   "
              f"rejections: {cfg.out / 'rejected.jsonl'}")
    return 0


def _cmd_merge(a) -> int:
    from fastpipe.convert.merge import merge_parts

    manifest = merge_parts(Path(a.out))
    print(f"merged {manifest.settings['parts']} parts: "
          + ", ".join(f"{n} {s.samples}" for n, s in manifest.splits.items()) + f" -> {a.out}/dataset.json")
    return 0


def _cmd_index(a) -> int:
    from fastpipe.convert.foreign import IndexConfig, index_shards

    manifest = index_shards(IndexConfig([Path(s) for s in a.shards], Path(a.out) if a.out else None,
                                        a.val, a.classes, a.stats_samples))
    print(f"indexed {sum(s.samples for s in manifest.splits.values())} samples in "
          f"{sum(len(s.shards) for s in manifest.splits.values())} shards -> {manifest.root / 'dataset.json'}")
    return 0


def _cmd_inspect(a) -> int:
    from fastpipe.convert.inspect import inspect

    report = inspect(Path(a.out), verify=a.verify)
    print("\n".join(report.lines))
    return 0 if report.ok else 1


def _cmd_train(a) -> int:
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.loop import TrainingStopped, train

    cfg = TrainConfig(
        data=a.data, model=a.model, backend=a.backend, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr,
        optimizer=a.optimizer, momentum=a.momentum, nesterov=not a.no_nesterov, weight_decay=a.weight_decay,
        warmup_epochs=a.warmup_epochs, label_smoothing=a.label_smoothing, image_size=a.image_size,
        progressive=a.progressive, amp=a.amp, accum_steps=a.accum_steps, channels_last=a.channels_last,
        checkpoint_activations=a.checkpoint_activations, compile=a.compile, device=a.device, workers=a.workers,
        out=a.out, resume=a.resume, stop_after=a.stop_after, seed=a.seed, pretrained=a.pretrained,
        balance=a.balance, class_weighted_loss=a.class_weighted_loss, sync_bn=a.sync_bn, auto_batch=a.auto_batch)
    try:
        run = train(cfg)
    except TrainingStopped as e:
        print(f"fastpipe train: stopped: {e}", file=sys.stderr)
        return 3
    print(f"run folder: {run}")
    return 0


def _cmd_memory(a) -> int:
    import json

    from fastpipe.train.memory import MemoryConfig, analyse, format_report

    classes = a.num_classes
    if a.data:
        from fastpipe.manifest import load

        classes = load(a.data).num_classes
    cfg = MemoryConfig(a.model, a.image_size, a.batch_size, a.optimizer, a.amp, classes, a.device, a.gpu_memory,
                       a.checkpoint_activations)
    report = analyse(cfg, techniques=not a.no_techniques)
    print(format_report(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0


def _cmd_runs(a) -> int:
    from fastpipe.train.runs import format_runs, list_runs

    print(format_runs(list_runs(Path(a.root))))
    return 0


def _list(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in str(text).split(",") if x.strip()]


def _workers(x: str):
    return None if x == "auto" else int(x)


def _onoff(x: str):
    if x not in ("on", "off", "auto"):
        raise argparse.ArgumentTypeError(f"{x!r}: use on, off or auto")
    return {"on": True, "off": False, "auto": None}[x]


def _cmd_bench(a) -> int:
    from fastpipe.bench.harness import BenchConfig, run_sweep
    from fastpipe.bench.report import plot, table, write_json

    base = BenchConfig(data=a.data, model=a.model, device=a.device, amp=a.amp, steps=a.steps, windows=a.windows,
                       channels_last=a.channels_last, max_seconds=a.max_seconds)
    sweep = {"backend": _list(a.backend), "workers": _list(a.workers, _workers),
             "batch_size": _list(a.batch_size, int), "image_size": _list(a.image_size, int),
             "pin_memory": _list(a.pin_memory, _onoff)}
    result = run_sweep(base, sweep, on_row=lambda r: print(
        f"  measured {r['config']['backend']}: {r.get('verdict', r.get('skipped', ''))[:70]}", flush=True))
    print(table(result))
    if a.json:
        write_json(result, a.json)
        print(f"json: {a.json}")
    if a.plot:
        plot(result, a.plot)
        print(f"plot: {a.plot}")
    return 0


def _cmd_doctor(a) -> int:
    from fastpipe.doctor import run_doctor

    return run_doctor()


def _add_shard(sub) -> None:
    p = sub.add_parser("shard", help="convert raw images into WebDataset shards (once)",
                       description="Convert an ImageFolder tree or a path,label list into shards of clean, "
                                   "downsampled RGB JPEGs with dataset.json, .idx files, previews and "
                                   "rejected.jsonl. Rerunning resumes; other settings need --overwrite.")
    p.add_argument("src", help="folder of class folders (optionally train/ and val/), or a CSV/TXT list")
    p.add_argument("out", help="output folder")
    p.add_argument("--short-side", type=int, default=320, help="stored shorter side in pixels, never upscaled")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of the stored images")
    p.add_argument("--val-fraction", type=float, default=0.1, help="stratified validation share "
                   "(ignored when SRC has train/ and val/ folders)")
    p.add_argument("--seed", type=int, default=0, help="seed for split and shuffle")
    p.add_argument("--max-shard-size", type=parse_size, default="256MB", help="e.g. 256MB, 64MB")
    p.add_argument("--max-pixels", type=int, default=200_000_000, help="refuse larger images (bomb guard)")
    p.add_argument("--workers", type=int, default=0, help="processes; 0 = every core")
    p.add_argument("--overwrite", action="store_true", help="replace a conversion made with other settings")
    p.add_argument("--part", type=int, default=0, help="this part's number, for cluster array jobs")
    p.add_argument("--parts", type=int, default=1, help="number of independent parts (then: fastpipe merge)")
    p.set_defaults(func=_cmd_shard)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a torchvision classifier on converted shards (AMP, DDP, run folder)",
                       description="Train on a `fastpipe shard` output. Under torchrun: DistributedDataParallel.")
    p.add_argument("data", help="converter output folder")
    p.add_argument("--model", default="resnet18", help="torchvision model name (resnet18/50, mobilenet_v3_large, "
                   "efficientnet_b0, convnext_tiny, vit_b_16, ...)")
    p.add_argument("--backend", default="torch", help="loader: torch | dali | nvjpeg | synthetic")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per device (per micro-batch with --accum-steps)")
    p.add_argument("--lr", type=float, help="default: 0.1 x effective batch / 256 (SGD), 1e-3 (AdamW)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--no-nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=5e-5)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--progressive", help="START:END, e.g. 128:224: small images first, full size at the end")
    p.add_argument("--amp", choices=["fp16", "bf16", "off"], help="default: fp16 (+GradScaler) on CUDA, off on CPU")
    p.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation: optimizer step every N "
                   "micro-batches, loss / N. BatchNorm still sees only the micro-batch")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute the deep stages' activations")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--workers", type=int, help="loader workers (default: measured once per machine and data set)")
    p.add_argument("--out", help="run folder (default runs/<time>-<model>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--stop-after", type=int, help="leave after N epochs (resumable), for time-limited jobs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrained", help="local weights file to start from (no downloads)")
    p.add_argument("--balance", action="store_true", help="class-balanced sampling")
    p.add_argument("--class-weighted-loss", action="store_true", help="weight the loss by the class weights")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks")
    p.add_argument("--auto-batch", action="store_true", help="find the largest batch that fits before training")
    p.set_defaults(func=_cmd_train)


def _add_memory(sub) -> None:
    p = sub.add_parser("memory", help="predict the GPU memory of a model + batch before it OOMs")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--amp", default="fp16", choices=["fp16", "bf16", "off"])
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--data", help="a converter output folder, for its class count")
    p.add_argument("--device", help="where to measure (default: cuda when available)")
    p.add_argument("--gpu-memory", type=parse_size, help="memory to plan for, e.g. 8GB (default: this GPU's)")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--no-techniques", action="store_true", help="skip the what-if table (faster)")
    p.add_argument("--json", help="also write the report as JSON")
    p.set_defaults(func=_cmd_memory)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="loader alone, model alone, both: which one limits training?",
                       description="Three measurements on the same settings and a verdict (loader-bound, "
                                   "device-bound, balanced) with advice. Comma-separated values sweep.")
    p.add_argument("data", help="converter output folder")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--device", help="cuda, cpu (default: cuda when available)")
    p.add_argument("--backend", default="torch", help="e.g. torch,dali,nvjpeg")
    p.add_argument("--workers", default="auto", help="e.g. 1,2,4,auto")
    p.add_argument("--batch-size", default="64", help="e.g. 32,64")
    p.add_argument("--image-size", default="224", help="e.g. 160,224")
    p.add_argument("--pin-memory", default="auto", help="on,off,auto")
    p.add_argument("--amp", choices=["fp16", "bf16", "off"], help="default: fp16 on CUDA, off on CPU")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--steps", type=int, default=20, help="timed steps per window")
    p.add_argument("--windows", type=int, default=3, help="timing windows per measurement (median reported)")
    p.add_argument("--max-seconds", type=float, help="cap each measurement (slow CPU setups)")
    p.add_argument("--json", help="write every figure, the settings, versions and device here")
    p.add_argument("--plot", help="PNG of the three rates per configuration, verdict in the title")
    p.set_defaults(func=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    import fastpipe

    ap = argparse.ArgumentParser(prog="fastpipe", description=fastpipe.__doc__)
    ap.add_argument("--version", action="version", version=f"fastpipe {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo-data", help="generate a demo photo collection (leaves and pipelines)")
    p.add_argument("out")
    p.add_argument("--count", type=int, default=180, help="number of photos")
    p.add_argument("--width", type=int, default=3264)
    p.add_argument("--height", type=int, default=2448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="processes; 0 = every core")
    p.set_defaults(func=_cmd_demo_data)

    _add_shard(sub)

    p = sub.add_parser("merge", help="merge the manifests of a --parts conversion")
    p.add_argument("out")
    p.set_defaults(func=_cmd_merge)

    p = sub.add_parser("index", help="dataset.json and .idx files for shards written by other tools")
    p.add_argument("shards", nargs="+", help="train shard files (use --val for validation shards)")
    p.add_argument("--val", nargs="*", default=[], help="validation shard files")
    p.add_argument("--out", help="folder for dataset.json (default: the shards' folder)")
    p.add_argument("--classes", help="text file of class names, one per line, in label order")
    p.add_argument("--stats-samples", type=int, default=2000, help="train images decoded for mean/std")
    p.set_defaults(func=_cmd_index)

    p = sub.add_parser("inspect", help="summary of a converted data set")
    p.add_argument("out")
    p.add_argument("--verify", action="store_true", help="check checksums and decode every sample")
    p.set_defaults(func=_cmd_inspect)

    _add_train(sub)
    _add_memory(sub)
    _add_bench(sub)
    p = sub.add_parser("runs", help="list training runs side by side")
    p.add_argument("root", nargs="?", default="runs")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser("doctor", help="check torch, CUDA, DALI and Pillow on this machine")
    p.set_defaults(func=_cmd_doctor)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        # Our own errors say what to do; a traceback would bury that.
        print(f"fastpipe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

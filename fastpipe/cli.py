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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fastpipe", description=__doc__.splitlines()[0] if __doc__ else None)
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

"""Command line: argparse subcommands → config dataclasses → the functions that do the work. Nothing else.

Each subcommand's flags are generated from its config dataclass (fastpipe.options.opt: help, default and parser
in one place). A `FastpipeError` prints as one line (what, allowed, fix); anything else is a bug and keeps its
traceback. Ctrl-C and SIGTERM end every command with a line that says how to continue.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import warnings
from pathlib import Path

from fastpipe import __version__
from fastpipe.errors import ConfigError, FastpipeError, FastpipeWarning, Interrupted
from fastpipe.options import add_config, config_from, given
from fastpipe.store.urls import check_location, local_path, redact

# OS errors that are the environment's, not a bug: reported in one line with the file they concern.
ENV_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT, errno.EPERM, errno.ENOENT, errno.EIO,
              errno.EMFILE, errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR}


# -- commands ---------------------------------------------------------------------------------------------
def _cmd_demo_data(a) -> int:
    from fastpipe.convert.demo import DemoConfig, make_demo_data

    cfg = config_from(a, DemoConfig)
    counts = make_demo_data(cfg)
    print(f"wrote {sum(counts.values())} photos to {cfg.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def _cmd_shard(a) -> int:
    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.util import reuse_freed_memory

    cfg = config_from(a, ShardConfig)
    reuse_freed_memory()  # the command's own process, which converts every photo itself with --workers 1
    summary = shard(cfg)
    print(redact("\n".join(summary.lines())))  # its notes quote a list's header row
    if cfg.parts > 1:
        print(f"part {cfg.part} of {cfg.parts} done; when all parts are: fastpipe merge {cfg.out}")
    else:
        out = str(cfg.out).rstrip("/")
        print(f"manifest: {out}/dataset.json   previews: {out}/previews   rejections: {out}/rejected.jsonl")
    return 0


def _cmd_merge(a) -> int:
    check_location(a.out)
    from fastpipe.convert.merge import merge_parts

    manifest = merge_parts(a.out)  # a folder, or a URL
    print(f"merged {manifest.settings['parts']} parts: "
          + ", ".join(f"{n} {s.samples}" for n, s in manifest.splits.items()) + f" -> {a.out}/dataset.json")
    return 0


def _cmd_index(a) -> int:
    from fastpipe.convert.foreign import IndexConfig, index_only, index_shards
    from fastpipe.store.location import in_stores

    cfg = config_from(a, IndexConfig)
    paths = [*cfg.train, *cfg.val]
    urls = in_stores(paths)  # walked by ranged reads where they are (adopt.py), never downloaded whole
    if urls and len(urls) < len(paths):
        raise ConfigError("index takes local shards or shards in a store, not both in one command")
    if cfg.idx_only:
        if urls:
            from fastpipe.convert.adopt import index_only_where_they_are

            n = index_only_where_they_are(urls)
        else:
            n = index_only([local_path(p, "shard") for p in paths])  # .idx files are written beside
        print(f"wrote .idx files for {len(cfg.train) + len(cfg.val)} shards ({n} samples); no manifest touched")
        return 0
    if urls:
        from fastpipe.convert.adopt import index_where_they_are

        manifest = index_where_they_are(cfg)
    else:
        manifest = index_shards(cfg)
    print(f"indexed {sum(s.samples for s in manifest.splits.values())} samples in "
          f"{sum(len(s.shards) for s in manifest.splits.values())} shards -> {manifest.location}/dataset.json"
          + (f"\nnote: {manifest.settings['note']}" if manifest.settings.get("note") else ""))
    if undecoded := manifest.settings.get("undecoded"):
        print(f"{len(undecoded)} of the images sampled for mean/std refused or failed to decode (left out; the loaders "
              f"skip them): " + "; ".join(undecoded[:3]) + ("; ..." if len(undecoded) > 3 else ""))
    return 0


def _threshold(text: str) -> int:
    try:
        bits = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of bits, 0..32") from None
    if not 0 <= bits <= 32:
        raise argparse.ArgumentTypeError(f"{bits}: use 0..32 bits (16 by default)")
    return bits


def _cmd_inspect(a) -> int:
    check_location(a.out)
    from fastpipe.convert.inspect import inspect
    from fastpipe.store.location import place

    out = place(a.out, "data set")
    report = inspect(out, verify=a.verify, repair=a.repair, cache_dir=a.cache_dir)
    print("\n".join(report.lines))
    if a.against:
        from fastpipe.convert.inspect import leaks

        other = place(a.against, "data set")
        print("\n".join(leaks(out, other, a.near_threshold, a.cache_dir)))
    return 0 if report.ok else 1


def _cmd_train(a) -> int:
    from fastpipe.train.config import TrainConfig

    settings = given(a, TrainConfig)
    if not settings.get("resume"):
        TrainConfig(**settings)  # every setting checked before torch is even imported
    from fastpipe.train.session import train_from_cli

    run = train_from_cli(settings)
    print(f"run folder: {run}")
    return 0


def _cmd_memory(a) -> int:
    import json

    from fastpipe.train.config import MemoryConfig

    extra = {}
    if a.data:
        from fastpipe.dataset.loading import load

        extra["num_classes"] = load(a.data).num_classes
    from fastpipe.train.memory import analyse, format_report

    report = analyse(config_from(a, MemoryConfig, **extra), techniques=not a.no_techniques,
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0


def _cmd_runs(a) -> int:
    from fastpipe.train.runs import format_runs, list_runs

    columns = [c.strip() for c in a.columns.split(",") if c.strip()] if a.columns is not None else None
    print(format_runs(list_runs(local_path(a.root, "runs folder"), columns)))
    return 0


def _cmd_bench(a) -> int:
    from fastpipe.bench.config import BenchConfig, split_sweep

    base, sweep = split_sweep(given(a, BenchConfig))
    BenchConfig(**base)  # checked before torch is imported (the swept values: when the grid is made)
    from fastpipe.bench.harness import process_start, run_sweep
    from fastpipe.bench.report import plot, table, write_json

    result = run_sweep(BenchConfig(**base), sweep, log=lambda line: print(line, flush=True), started=process_start())
    print(table(result))
    if a.json:
        write_json(result, a.json)
        print(f"json: {a.json}")
    if a.plot:
        plot(result, a.plot)
        print(f"plot: {a.plot}")
    return 0


def _cmd_predict(a) -> int:
    from fastpipe.predict.config import PredictConfig

    cfg = config_from(a, PredictConfig)
    from fastpipe.predict.run import predict

    result = predict(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(result.lines))
    return 0


def _cmd_export(a) -> int:
    from fastpipe.predict.config import ExportConfig

    cfg = config_from(a, ExportConfig)
    from fastpipe.predict.export import export

    export(cfg)
    return 0


def _cmd_doctor(a) -> int:
    from fastpipe.doctor import run_doctor

    return run_doctor()


# -- the parser -------------------------------------------------------------------------------------------
def _configured(sub, name: str, cls, func, hint: str, **kw) -> argparse.ArgumentParser:
    p = sub.add_parser(name, **kw)
    add_config(p, cls)
    p.set_defaults(func=func, interrupt_hint=hint)
    return p


def build_parser() -> argparse.ArgumentParser:
    import fastpipe
    from fastpipe.bench.config import BenchConfig
    from fastpipe.convert.demo import DemoConfig
    from fastpipe.convert.driver import ShardConfig
    from fastpipe.convert.foreign import IndexConfig
    from fastpipe.predict.config import ExportConfig, PredictConfig
    from fastpipe.train.config import MemoryConfig, TrainConfig

    ap = argparse.ArgumentParser(prog="fastpipe", description=fastpipe.__doc__)
    ap.add_argument("--version", action="version", version=f"fastpipe {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    again = "rerun the same command to continue"
    _configured(sub, "demo-data", DemoConfig, _cmd_demo_data, again,
                help="generate a demo photo collection (leaves and pipelines)")
    _configured(sub, "shard", ShardConfig, _cmd_shard, again + " (finished shards are kept)",
                help="convert raw images into WebDataset shards (once)",
                description="Convert an ImageFolder tree or a path,label list into shards of clean, downsampled "
                            "RGB JPEGs with dataset.json, .idx files, previews and rejected.jsonl. Rerunning "
                            "resumes; other settings need --overwrite.")
    p = sub.add_parser("merge", help="merge the manifests of a --parts conversion")
    p.add_argument("out", help="the folder or store URL (s3://bucket/prefix, hf://...) the parts were written to")
    p.set_defaults(func=_cmd_merge, interrupt_hint=again)
    _configured(sub, "index", IndexConfig, _cmd_index, again,
                help="dataset.json and .idx files for shards written by other tools (--idx-only: the .idx only)")
    p = sub.add_parser("inspect", help="summary of a converted data set; --verify, --repair")
    p.add_argument("out", help="a converted data set: its folder or URL (s3://..., hf://datasets/ORG/NAME, ...)")
    p.add_argument("--verify", action="store_true", help="check checksums and decode every sample")
    p.add_argument("--repair", action="store_true", help="with --verify's findings: leave undecodable samples out "
                   "of the .idx files (what DALI needs; the shards are not touched); of a URL, the new files are "
                   "uploaded, dataset.json last")
    p.add_argument("--cache-dir", help="for a URL: the node cache the shards are read through (default "
                   "~/.cache/fastpipe/shards or $FASTPIPE_CACHE)")
    p.add_argument("--against", metavar="B", help="another converted data set: the photos of this one with a "
                   "near-copy in B (a test set against a training set), and near-copies.jpg showing them")
    p.add_argument("--near-threshold", type=_threshold, default=None, help="bits within which fingerprints are "
                   "near-copies (default: the one this data set was converted with)")
    p.set_defaults(func=_cmd_inspect, interrupt_hint=again)
    _configured(sub, "train", TrainConfig, _cmd_train, "",
                help="train a torchvision classifier on converted shards (AMP, DDP, run folder)",
                description="Train on a `fastpipe shard` output. Under torchrun: DistributedDataParallel.")
    p = _configured(sub, "memory", MemoryConfig, _cmd_memory, again,
                    help="predict the GPU memory of a model + batch before it OOMs")
    p.add_argument("--data", help="a converter output folder, for its class count")
    p.add_argument("--no-techniques", action="store_true", help="skip the what-if table (faster)")
    p.add_argument("--json", help="also write the report as JSON")
    p = _configured(sub, "bench", BenchConfig, _cmd_bench, "the figures measured so far are printed above",
                    help="loader alone, model alone, both: which one limits training?",
                    description="Three measurements on the same settings and a verdict (loader-bound, "
                                "device-bound, balanced) with advice. Comma-separated values sweep.")
    p.add_argument("--json", help="write every figure, the settings, versions and device here")
    p.add_argument("--plot", help="PNG of the three rates per configuration, verdict in the title")
    _configured(sub, "predict", PredictConfig, _cmd_predict, "nothing was written; rerun the command",
                help="classify new photos with a trained run or an exported model, prepared as in training",
                description="Each photo is prepared exactly as the model's training photos were (the converter's "
                            "image step, then the validation transform) and scored; a CSV (or JSON lines) row per "
                            "photo, and accuracy, confusion and mistakes when SRC has labels.")
    _configured(sub, "export", ExportConfig, _cmd_export, "rerun the command",
                help="write a trained run as one ONNX or torch.export file (uint8 in, probabilities out)")
    p = sub.add_parser("runs", help="list training runs side by side")
    p.add_argument("root", nargs="?", default="runs")
    p.add_argument("--columns", default=None, help="settings to show, comma-separated (default: those that differ "
                                                  "between the runs listed), e.g. image_size,lr,augment")
    p.set_defaults(func=_cmd_runs, interrupt_hint="")
    p = sub.add_parser("doctor", help="check torch, CUDA, DALI, Pillow and shared memory on this machine")
    p.set_defaults(func=_cmd_doctor, interrupt_hint="")
    return ap


def _on_sigterm(signum, frame):
    raise Interrupted("SIGTERM")


def _show_warning(message, category, filename, lineno, file=None, line=None, _plain=warnings.showwarning):
    """fastpipe's own warnings as one line each, without the source line Python adds; others as usual."""
    if issubclass(category, FastpipeWarning):
        print(f"fastpipe: warning: {redact(str(message))}", file=file or sys.stderr)
    else:
        _plain(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = _show_warning
    # Ctrl-C must reach us even when started from a script in the background (which starts Python with SIGINT
    # ignored), so that every command ends through the same clean-up and message.
    previous = signal.signal(signal.SIGTERM, _on_sigterm), signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        sigterm = getattr(e, "signal_name", "SIGINT") == "SIGTERM"
        what = "terminated (SIGTERM)" if sigterm else "interrupted"
        print(f"fastpipe {args.command}: {what}" + (f"; {args.interrupt_hint}" if args.interrupt_hint else ""),
              file=sys.stderr)
        return 143 if sigterm else 130
    except FastpipeError as e:
        print(f"fastpipe {args.command}: error: {redact(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in ENV_ERRNOS:
            raise
        print(f"fastpipe {args.command}: error: {e.strerror} ({redact(str(e.filename or e))})", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


if __name__ == "__main__":
    sys.exit(main())

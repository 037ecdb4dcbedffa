"""The crop-aware JPEG decoder against the full-decode path on the same stored samples and the same draws, in one
process and in the loader, at two stored sizes; DALI's CPU `fn.decoders.image_random_crop` beside them.

    python benchmarks/bench_crop.py --rounds 9 --json docs/results/crop.json

Demo photos are sharded at each `--sides` short side. One process: decode + random-resized-crop 224 + flip → uint8
into one batch slot (train), or resize + centre crop (val), by cpu_decoder "crop" and "simplejpeg" (the full-decode
path) with the same draws, over every training sample; progressive re-encodings of the first set's samples too.
Loader: the torch backend at its defaults, batch 64, `--workers` workers, uint8 out (as handed to a device), with the
crop decoder and with cpu_decoder="simplejpeg", against workers x the same round's one-process full-decode rate.
DALI: image_random_crop + resize + coin-flip mirror, CPU only (device_id=None), one thread, batch 64 (its own draws,
of the same distribution). Each round runs every variant once in a shuffled order; figures are medians over the
rounds with their ranges, ratios are of the same round's runs.
Targets: one process >= 1.25x the full-decode path at 320, >= 1.35x at 512; the loader (the crop decoder's training
samples through C, a chunk at a time) >= 1.25 x workers x the one-process full-decode rate at 320, >= 1.3x at 512.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_peers import interleaved, run_loader
from PIL import Image

from fastpipe import make_loader
from fastpipe.bench.timing import run_fresh, spread
from fastpipe.dataset.loading import load
from fastpipe.loaders import cpu_ops, jpegcrop
from fastpipe.loaders.epoch import Piece
from fastpipe.loaders.shards import ShardSet

BATCH, SIZE = 64, 224
TARGETS = {"single": {320: 1.25, 512: 1.35}, "loader": {320: 1.25, 512: 1.3}}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=800)
    ap.add_argument("--sides", default="320,512", help="stored short sides, comma-separated")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--epochs", type=int, default=3, help="timed loader epochs per run, after the first")
    ap.add_argument("--progressive", type=int, default=300, help="samples re-encoded progressive (first side)")
    ap.add_argument("--no-dali", action="store_true")
    ap.add_argument("--data", help="keep the photos and shards in this folder and reuse them on the next run")
    ap.add_argument("--dali-one", help=argparse.SUPPRESS)  # SHARDS: one timed DALI pass, in a fresh process
    ap.add_argument("--json", default="bench-results/crop.json")
    return ap.parse_args(argv)


def make_sets(args, base: Path) -> dict[int, Path]:
    from fastpipe.convert.demo import DemoConfig, make_demo_data
    from fastpipe.convert.driver import ShardConfig, shard

    if not (base / "raw").is_dir():
        make_demo_data(DemoConfig(base / "raw", count=args.photos, width=1632, height=1224))
    out = {}
    for side in [int(s) for s in args.sides.split(",")]:
        out[side] = base / f"shards-{side}"
        if not (out[side] / "dataset.json").exists():
            shard(ShardConfig(base / "raw", out[side], short_side=side, max_shard_size=4 * 2**20,
                              val_fraction=0.05))
    return out


def samples(out: Path) -> list[bytes]:
    shards = ShardSet(load(out), "train")
    return [bytes(s.image) for i, n in enumerate(shards.counts) for s in shards.read_piece(Piece(i, 0, n))]


def progressive(datas: list[bytes]) -> list[bytes]:
    """The same pictures as progressive JPEGs (quality 90, 4:2:0, as the converter stores baseline ones)."""
    out = []
    for d in datas:
        buf = io.BytesIO()
        Image.open(io.BytesIO(d)).save(buf, "JPEG", quality=90, subsampling="4:2:0", progressive=True)
        out.append(buf.getvalue())
    return out


def one_process(datas: list[bytes], decoder: str, split: str):
    """img/s of decode + crop (+ flip) into one batch slot; the same seed, so both decoders get the same boxes."""
    def run() -> dict:
        rng, slot = np.random.default_rng(0), np.empty((SIZE, SIZE, 3), np.uint8)
        t = time.perf_counter()
        for d in datas:
            if split == "train":
                cpu_ops.decode_train(d, SIZE, rng, decoder=decoder, out=slot)
            else:
                cpu_ops.decode_val(d, SIZE, decoder=decoder, out=slot)
        return {"img_per_s": len(datas) / (time.perf_counter() - t)}

    return run


def dali(out: Path):
    """DALI's fused random crop decode on the CPU, one thread: what the dali backend runs without a GPU. In a
    process of its own: with DALI imported, fastpipe's loader workers would start from a fork server instead of
    forking (stream.py), which the loader rows must not measure."""
    return lambda: run_fresh([__file__, "--dali-one", str(out)], "DALI's pass")


def dali_pass(datas: list[bytes]) -> dict:
    from nvidia.dali import fn, pipeline_def, types

    arrays = [np.frombuffer(d, np.uint8) for d in datas]
    batches = len(arrays) // BATCH
    if not batches:
        raise SystemExit(f"DALI's row needs at least {BATCH} training samples: more --photos, or --no-dali")

    def feed(info):
        i = info.iteration % batches * BATCH
        return arrays[i : i + BATCH]

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=0)
    def graph():
        jpegs = fn.external_source(source=feed, batch=True, batch_info=True, dtype=types.UINT8)
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE, interp_type=types.INTERP_LINEAR, antialias=True)
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="HWC", crop=(SIZE, SIZE),
                                        mirror=fn.random.coin_flip(probability=0.5))

    pipe = graph()
    pipe.build()
    pipe.run()  # warm: DALI allocates its buffers on the first batches
    t = time.perf_counter()
    for _ in range(batches):
        pipe.run()
    return {"img_per_s": batches * BATCH / (time.perf_counter() - t)}


def loader(out: Path, decoder: str, args):
    def build():
        ld = make_loader(out, "torch", batch_size=BATCH, image_size=SIZE, num_workers=args.workers, device="cpu",
                         normalize=False, cpu_decoder=decoder)
        return ld, ld.set_epoch

    return lambda: run_loader(build, args.epochs)


def variants(sets: dict[int, Path], args) -> dict:
    v = {}
    for k, (side, out) in enumerate(sets.items()):
        datas = samples(out)
        for dec, name in (("simplejpeg", "full"), ("crop", "crop")):
            v[f"{side} train {name}"] = one_process(datas, dec, "train")
            v[f"{side} val {name}"] = one_process(datas, dec, "val")
            v[f"{side} loader {name}"] = loader(out, dec, args)
        if k == 0 and args.progressive:
            prog = progressive(datas[: args.progressive])
            v[f"{side} progressive train full"] = one_process(prog, "simplejpeg", "train")
            v[f"{side} progressive train crop"] = one_process(prog, "crop", "train")
        if not args.no_dali:
            v[f"{side} train dali image_random_crop"] = dali(out)
    return v


def ratio(runs: dict, a: str, b: str, times: float = 1.0) -> dict:
    return spread([x["img_per_s"] / (times * y["img_per_s"]) for x, y in zip(runs[a], runs[b])])


def report(runs: dict, sets: dict, args) -> dict:
    sides = {}
    for side in sets:
        s = {"rates": {k.split(" ", 1)[1]: spread([r["img_per_s"] for r in v]) for k, v in runs.items()
                       if k.startswith(f"{side} ")},
             "train_crop_over_full": ratio(runs, f"{side} train crop", f"{side} train full"),
             "val_crop_over_full": ratio(runs, f"{side} val crop", f"{side} val full"),
             "loader_crop_over_workers_x_full": ratio(runs, f"{side} loader crop", f"{side} train full", args.workers),
             "loader_full_over_workers_x_full": ratio(runs, f"{side} loader full", f"{side} train full", args.workers),
             "loader_crop_over_workers_x_crop": ratio(runs, f"{side} loader crop", f"{side} train crop", args.workers),
             "loader_crop_over_loader_full": ratio(runs, f"{side} loader crop", f"{side} loader full")}
        if f"{side} progressive train crop" in runs:
            s["progressive_crop_over_full"] = ratio(runs, f"{side} progressive train crop",
                                                    f"{side} progressive train full")
        if f"{side} train dali image_random_crop" in runs:
            s["crop_over_dali"] = ratio(runs, f"{side} train crop", f"{side} train dali image_random_crop")
        targets = {k: t[side] for k, t in TARGETS.items() if side in t}
        if targets:
            s["targets"] = {**targets, "single_met": s["train_crop_over_full"]["median"] >= targets["single"],
                            "loader_met": s["loader_crop_over_workers_x_full"]["median"] >= targets["loader"]}
        s["stored_short_side"] = side
        s["train_samples"] = load(sets[side]).splits["train"].samples
        sides[str(side)] = s
    return {"benchmark": "crop", "rounds": args.rounds, "workers": args.workers, "batch": BATCH, "size": SIZE,
            "photos": args.photos, "decoder": cpu_ops.active(), "sides": sides,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__}, "versions": _versions()}


def _versions() -> dict:
    import importlib.metadata as md

    out = {"libjpeg-turbo (crop decoder)": jpegcrop.ext.LIBJPEG_TURBO_VERSION if jpegcrop.ext else None}
    for name in ("simplejpeg", "opencv-python-headless", "nvidia-dali-cuda130", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def table(res: dict) -> str:
    def r(v, f=".2f"):
        return f"{v['median']:{f}} ({v['low']:{f}}-{v['high']:{f}})"

    lines = [f"{res['decoder']}", f"{res['rounds']} rounds, {res['workers']} workers, median (range)"]
    for side, s in res["sides"].items():
        lines += ["", f"stored short side {side} ({s['train_samples']} training samples), images/s:"]
        lines += [f"  {k:<34} {r(v, ',.0f')}" for k, v in s["rates"].items()]
        prog = f", progressive {r(s['progressive_crop_over_full'])}" if "progressive_crop_over_full" in s else ""
        vs_dali = f"; crop ÷ DALI {r(s['crop_over_dali'])}" if "crop_over_dali" in s else ""
        lines.append(f"  one process, crop ÷ full: train {r(s['train_crop_over_full'])}, val "
                     f"{r(s['val_crop_over_full'])}{prog}{vs_dali}")
        lines.append(f"  loader ÷ (workers x one-process full): crop {r(s['loader_crop_over_workers_x_full'])}, full "
                     f"{r(s['loader_full_over_workers_x_full'])}; crop loader ÷ (workers x one-process crop) "
                     f"{r(s['loader_crop_over_workers_x_crop'])}")
        if "targets" in s:
            t = s["targets"]
            lines.append(f"  targets: one process >= {t['single']} ({'met' if t['single_met'] else 'NOT met'}), "
                         f"loader >= {t['loader']} ({'met' if t['loader_met'] else 'NOT met'})")
    return "\n".join(lines)


def main(args) -> dict:
    jpegcrop.require()
    torch.set_num_threads(1)
    base = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="fp-crop-"))
    try:
        sets = make_sets(args, base)
        load_before = os.getloadavg()
        runs = interleaved(variants(sets, args), args.rounds)
        # The loader rows need every core: other work on the machine costs them more than the one-process rows.
        return {**report(runs, sets, args), "load_average_1_5_15_min": {"start": load_before, "end": os.getloadavg()}}
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    a = parse_args()
    if a.dali_one:
        print(json.dumps(dali_pass(samples(Path(a.dali_one)))))
        raise SystemExit(0)
    result = main(a)
    print(table(result))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))

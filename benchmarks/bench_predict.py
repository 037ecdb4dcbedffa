"""`fastpipe predict` on raw photos against its bound, and against the script users write without it.

- bound: one process doing predict's per-photo work in a plain loop (read + the converter's image step + the
  validation transform), no model; times the worker count (default 2).
- predict: `fastpipe predict RUN PHOTOS` as the CLI runs it (worker processes, temporary shards, the val loader,
  the model), photos per second from the call's start to its end.
- torchvision: the usual script: a DataLoader with the same workers over PIL.open + Resize + CenterCrop +
  ToTensor + Normalize, the same model. Its pixels are not the training pixels (see docs/guide/predict.md).
- model: the network alone on the batches, for what is left to the data path.

The run is trained here on a few demo photos (its accuracy does not matter), with --model (default
mobilenet_v3_small: a model whose cost does not hide the data path on a CPU).

    python benchmarks/bench_predict.py --photos 60 --workers 2 --json bench-results/predict.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from fastpipe.convert.demo import DemoConfig, make_demo_data
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.loaders import cpu_ops
from fastpipe.predict.config import PredictConfig
from fastpipe.predict.model import load_model
from fastpipe.predict.photos import prepare, settings_of
from fastpipe.predict.run import predict
from fastpipe.train.config import TrainConfig
from fastpipe.train.session import train


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=60, help="demo photos (3264x2448) to predict")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="mobilenet_v3_small")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="rounds, each measuring every variant once (interleaved)")
    ap.add_argument("--json", default="bench-results/predict.json")
    return ap.parse_args(argv)


def make_run(base: Path, args) -> tuple[Path, list[Path]]:
    photos = base / "photos"
    make_demo_data(DemoConfig(photos, count=args.photos, workers=args.workers))
    shard(ShardConfig(photos, base / "shards", workers=args.workers))
    run = train(TrainConfig(data=str(base / "shards"), out=str(base / "run"), model=args.model, epochs=1,
                            image_size=args.image_size, batch_size=4, device="cpu", workers=0))
    return run, usable(sorted(p for p in photos.rglob("*") if p.is_file()))


def usable(files: list[Path]) -> list[Path]:
    """The demo's photos less the broken ones it holds on purpose (the torchvision script would stop on them)."""
    from PIL import Image

    good = []
    for f in files:
        try:
            with Image.open(f) as im:
                im.load()
            good.append(f)
        except OSError:
            pass
    return good


def bound(files: list[Path], card: dict) -> float:
    settings, out = settings_of(card), None
    start = time.perf_counter()
    for f in files:
        out = cpu_ops.decode_val(prepare(f.read_bytes(), settings), card["image_size"], card["val_crop"],
                                 card["cpu_decoder"], out)
    return len(files) / (time.perf_counter() - start)


def with_predict(run: Path, photos: Path, files: list[Path], args, out: Path) -> float:
    start = time.perf_counter()
    listed = out.with_suffix(".txt")
    listed.write_text("".join(f"{f.relative_to(photos)},{f.parent.name}\n" for f in files))
    predict(PredictConfig(str(run), [str(listed)], out=str(out), workers=args.workers, batch_size=args.batch_size,
                          device="cpu"), log=lambda line: None)
    return len(files) / (time.perf_counter() - start)


def with_torchvision(run: Path, files: list[Path], args) -> float:
    from PIL import Image
    from torchvision import transforms as T

    model = load_model(run, device="cpu")
    card = model.card
    tf = T.Compose([T.Resize(round(card["image_size"] / card["val_crop"])), T.CenterCrop(card["image_size"]),
                    T.PILToTensor()])

    class Photos(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            return tf(Image.open(files[i]).convert("RGB"))

    start = time.perf_counter()
    loader = torch.utils.data.DataLoader(Photos(), batch_size=args.batch_size, num_workers=args.workers)
    for x in loader:
        model.scores(x)
    return len(files) / (time.perf_counter() - start)


def model_only(run: Path, args) -> float:
    model = load_model(run, device="cpu")
    x = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8)
    model.scores(x)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 5:
        model.scores(x)
        n += len(x)
    return n / (time.perf_counter() - start)


def main(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        run, files = make_run(base, args)
        card = load_model(run, device="cpu").card
        rounds = []
        for r in range(args.repeat):
            one = bound(files, card)
            row = {"bound": one * args.workers, "one_process": one,
                   "predict": with_predict(run, base / "photos", files, args, base / "photos" / f"p{r}.csv"),
                   "torchvision": with_torchvision(run, files, args), "model": model_only(run, args)}
            rounds.append(row)
            print("  ".join(f"{k} {v:.1f}/s" for k, v in row.items()), flush=True)
    best = {k: max(r[k] for r in rounds) for k in rounds[0]}
    result = {"photos": len(files), "workers": args.workers, "model": args.model, "image_size": args.image_size,
              "rounds": rounds, "best": best, "predict_vs_bound": best["predict"] / best["bound"],
              "predict_vs_torchvision": best["predict"] / best["torchvision"],
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load": os.getloadavg()}, "torch": torch.__version__}
    print(f"predict {best['predict']:.1f} photos/s = {result['predict_vs_bound']:.2f} of the bound "
          f"({best['bound']:.1f}); {result['predict_vs_torchvision']:.2f}x the torchvision script; model alone "
          f"{best['model']:.0f} img/s")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(parse_args())

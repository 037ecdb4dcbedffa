"""`fastpipe export RUN OUT`: the trained model as one file that runs without fastpipe or the training code.

OUT.onnx (ONNX, checked by running it in ONNX Runtime) or OUT.pt2 (torch.export). Either takes a uint8 RGB NCHW
batch at the run's image size, named `images`, and gives `probabilities` (softmax; per-class sigmoid for a
multi-label model): the normalisation is inside the graph, so no consumer can get mean and std wrong. Beside it,
OUT.EXT.json holds what a consumer needs to prepare a photo (the model card: stored short side, resize and crop,
class names, label mode, thresholds) and the file's sha256, which `fastpipe predict` checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from fastpipe import __version__
from fastpipe.errors import DataError, MissingDependency
from fastpipe.predict.config import ExportConfig
from fastpipe.predict.model import EXPORT_FORMAT, EXPORT_VERSION, file_sha256, sidecar, trained_network
from fastpipe.util import atomic_write_text, write_json_atomic

MAX_BATCH = 4096
TOLERANCE = 1e-4  # probabilities: the exported graph against the network in PyTorch


class Packaged(nn.Module):
    """uint8 NCHW RGB → probabilities, the normalisation of the loaders' device step inside (the same float32
    operations, mean and std scaled by 255, std at least one grey level)."""

    def __init__(self, net: nn.Module, card: dict):
        super().__init__()
        self.net, self.multilabel = net, card["task"] == "multilabel"
        self.register_buffer("mean", torch.tensor(card["mean"]).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(card["std"]).view(1, 3, 1, 1).clamp(min=1 / 255) * 255)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.net((images.float() - self.mean) / self.std)
        return out.sigmoid() if self.multilabel else out.softmax(1)


def export(cfg: ExportConfig, log=print) -> Path:
    net, card, source, notes = trained_network(cfg.run, cfg.weights)
    for note in notes:
        log(f"note: {note}")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = Packaged(net, card).eval().requires_grad_(False)  # a consumer's outputs carry no autograd graph
    size = card["image_size"]
    example = torch.randint(0, 256, (2, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    shapes = {"images": {0: torch.export.Dim("batch", min=1, max=MAX_BATCH)}}
    # Written in a folder of its own, made here with an unpredictable name (no link planted beside OUT is followed),
    # then renamed into place; torch.export wants its own extension.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as folder:
        tmp = Path(folder) / f"model{out.suffix.lower()}"
        if out.suffix.lower() == ".onnx":
            _onnx(model, example, shapes, tmp)
        else:
            torch.export.save(torch.export.export(model, (example,), dynamic_shapes=shapes), str(tmp))
            _checkable(tmp)
        os.replace(tmp, out)
    record = _record(card, out, source)
    if out.suffix.lower() == ".pt2":
        from fastpipe.predict import trust

        trust.remember(record["export"]["sha256"])  # this user's export: predict loads it without being told
    write_json_atomic(sidecar(out), record)
    atomic_write_text(standalone_path(out), standalone(card, out.name))
    log(f"exported {source} to {out} (input: uint8 RGB NCHW, {size}x{size}; output: probabilities of "
        f"{len(card['classes'])} classes), {sidecar(out).name} and {standalone_path(out).name} (the preparation "
        f"without fastpipe)")
    return out


def standalone_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.prepare.py")


def standalone(card: dict, model_name: str) -> str:
    """standalone.py with this model's record and file name in it (as Python literals: names are data, not code)."""
    from fastpipe.predict import standalone as template

    text = Path(template.__file__).read_text(encoding="utf-8")
    text = text.replace('CARD = json.loads("{}")', f"CARD = json.loads({json.dumps(card)!r})", 1)
    return text.replace('MODEL = ""', f"MODEL = {model_name!r}", 1)


def _checkable(tmp: Path) -> None:
    """The .pt2 passes the check `predict` makes before loading one (every export fastpipe writes can be used)."""
    from fastpipe.predict.pt2 import check_archive
    from fastpipe.train.runs import RunError

    try:
        check_archive(tmp.read_bytes(), tmp)
    except RunError as e:
        raise DataError(f"this model's .pt2 holds what `fastpipe predict` refuses to load from a file ("
                        f"{str(e).split(': ', 1)[-1][:200]}): export it to .onnx instead") from None


def _onnx(model: nn.Module, example: torch.Tensor, shapes: dict, tmp: Path) -> None:
    try:
        import onnx  # noqa: F401  (torch.onnx needs it, and onnxscript)
        import onnxruntime as ort
        import onnxscript  # noqa: F401
    except ImportError:
        raise MissingDependency(".onnx export needs ONNX, onnxscript and ONNX Runtime: pip install "
                                "'fastpipe[export]' (or export to a .pt2 file, which needs only torch)") from None
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
        torch.onnx.export(model, (example,), str(tmp), input_names=["images"], output_names=["probabilities"],
                          dynamic_shapes=shapes, dynamo=True, external_data=False)
    session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"images": example.numpy()})[0])
    with torch.no_grad():
        want = model(example)
    if not torch.allclose(got, want, atol=TOLERANCE, rtol=0):
        raise DataError(f"the ONNX graph gives other probabilities than the model (by up to "
                        f"{(got - want).abs().max().item():.2g}): this model does not export to ONNX faithfully; "
                        f"export to a .pt2 file instead")


def _record(card: dict, out: Path, source: str) -> dict:
    return {"inference": card, "export": {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "file": out.name, "sha256": file_sha256(out),
        "from": source, "fastpipe": __version__,
        "input": {"name": "images", "dtype": "uint8", "layout": "NCHW", "channels": "RGB",
                  "shape": ["batch", 3, card["image_size"], card["image_size"]]},
        "output": {"name": "probabilities", "activation": "sigmoid" if card["task"] == "multilabel" else "softmax",
                   "classes": card["classes"]},
        "prepare": prepare_steps(card)}}


def prepare_steps(card: dict) -> list[str]:
    """The preparation of a photo, in words, with every rule and parameter the pixels depend on."""
    size, crop, c = card["image_size"], card["val_crop"], card.get("convert")
    steps = ([f"as the converter stored the training photos: (w, h) is the photo's size and (tw, th) that size with "
              f"its shorter side {c['short_side']} px (each side round(side x {c['short_side']} / shorter side), "
              f"never larger than the photo); a JPEG is decoded with libjpeg's DCT scaling to the smallest of 1/1, "
              f"1/2, 1/4, 1/8 of its size whose sides are at least int(tw x {c['draft_gap']:g}) and "
              f"int(th x {c['draft_gap']:g}) (Pillow: Image.draft('RGB', (int(tw x {c['draft_gap']:g}), "
              f"int(th x {c['draft_gap']:g})))), other formats in full; the EXIF orientation is applied; it is made "
              f"RGB (transparency flattened onto white, 16-bit values scaled by 255/65535); it is resized to (tw, th) "
              f"with Pillow's LANCZOS, reducing_gap=3.0, when that differs from its size; it is encoded as JPEG "
              f"quality {c['quality']}, 4:2:0, and that JPEG is what the next step decodes"]
             if c else ["the photo as it is (the model was trained on shards another tool wrote)"])
    steps += [f"validation's centre crop: side = min(w, h) x {crop:g} of the stored JPEG's size (w, h); the box "
              f"x0 = round((w - side) / 2), x1 = round((w + side) / 2), y0, y1 alike, at least 1 px each way; when "
              f"the box is at least {2 * size} px a side the JPEG is decoded DCT-scaled by the largest 1/2, 1/4, "
              f"1/8 that keeps the box at least {size} px (the scaled size rounded up, the box's corners scaled and "
              f"rounded); the box is resized to {size}x{size} with OpenCV, INTER_AREA (area averaging) when it is "
              f"at least {2 * size} px a side, else INTER_LINEAR (half-pixel centres, edges clamped, weights in "
              f"1/2048); uint8 RGB, channels first",
              "MODEL.prepare.py beside the model does all of this with NumPy and Pillow (prepare(paths), "
              "classify(paths), or run it with photo paths); with OpenCV installed for the last resize it gives "
              "fastpipe's pixels exactly (Pillow's draft((w // d, h // d)) asks for scale 1/d), without OpenCV "
              "its NumPy filters are within 1 grey level; for fastpipe's own pixels, "
              "fastpipe.Predictor(...).inputs(...) or `fastpipe predict`"]
    return steps

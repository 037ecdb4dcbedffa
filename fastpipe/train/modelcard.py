"""What a trained model needs to be used on new photos, recorded with its weights: the model card.

Every checkpoint (last.pt, best.pt), every run's config.json and every exported model's JSON carry it under
"inference". It names the architecture and classes, and the exact preparation the weights learned from: the
converter's image step (stored short side, JPEG quality, pixel limit) and the validation transform (image size,
centre-crop fraction, decoder, mean/std). A prediction that prepares a photo any other way feeds the model pixels
it never saw (train/serve skew); `fastpipe predict` and `fastpipe export` follow this record exactly.

A card read back (from a checkpoint, a run folder, an exported file's JSON) is hostile until `check`ed: one
error naming the file, the field and what is allowed.
"""

from __future__ import annotations

import math
import re

from fastpipe.errors import DataError
from fastpipe.options import MAX_IMAGE_SIZE, STD_FLOOR

FORMAT = "fastpipe-model"
VERSION = 1
TASKS = ("single", "multilabel")
DECODERS = ("auto", "crop", "simplejpeg", "pillow")
BACKENDS = ("torch", "dali", "nvjpeg")


class CardError(DataError):
    """A model card that is missing, damaged, of another version or not fastpipe's."""


def make(model: str, classes, task: str, image_size: int, mean, std, amp: str, convert: dict | None,
         val_crop: float, cpu_decoder: str, thresholds=None, backend: str = "torch", decoder: str = "",
         weights: str = "") -> dict:
    """The card of a run's model. `convert`: the data set's conversion settings (None for shards indexed from
    another tool, whose images were used as they were). `backend`: the loader backend validation ran on, and
    `decoder` the CPU decoder it resolved to (cpu_ops.active): other ones give other pixels. `weights`: what
    training started from (the zoo's weights and tag, a file's name, or "" from scratch); `zoo`: whose model."""
    return {"format": FORMAT, "version": VERSION, "model": model, "classes": list(classes), "task": task,
            "image_size": int(image_size), "val_crop": float(val_crop), "cpu_decoder": cpu_decoder,
            "mean": [float(x) for x in mean], "std": [float(x) for x in std], "amp": amp, "convert": convert,
            "thresholds": None if thresholds is None else [float(t) for t in thresholds], "backend": backend,
            "decoder": decoder, "zoo": "timm" if model.startswith("timm:") else "torchvision", "weights": weights}


def convert_settings(settings: dict, foreign: bool) -> dict | None:
    """The converter's image step as a data set's dataset.json records it (None for foreign shards)."""
    if foreign:
        return None
    from fastpipe.convert.images import ImageSettings

    d = ImageSettings()
    return {"short_side": int(settings.get("short_side", d.short_side)), "quality": int(settings.get("quality",
            d.quality)), "max_pixels": int(settings.get("max_pixels", d.max_pixels)), "draft_gap": d.draft_gap}


def check(card, where: str) -> dict:
    """The card, every field checked; a CardError naming `where` and the field otherwise."""
    def need(ok, field: str, allowed: str):
        if not ok:
            got = card.get(field) if isinstance(card, dict) else card
            raise CardError(f"{where}: its model record's {field} is {str(got)[:60]!r}, expected {allowed}: a "
                            f"damaged or hand-edited file, or not fastpipe's. Train or export the model again")

    need(isinstance(card, dict) and card.get("format") == FORMAT, "format", f"{FORMAT!r}")
    version = card.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise CardError(f"{where}: written by a fastpipe of model-record version {str(version)[:20]!r}; this "
                        f"fastpipe reads version {VERSION}: upgrade fastpipe (pip install -U fastpipe), or export the "
                        f"model again with this one")
    model = card.get("model")
    need(isinstance(model, str) and (model.isidentifier() or bool(re.fullmatch(r"timm:\w+(\.\w+)?", model))),
         "model", "a torchvision model name, or timm:NAME")
    classes = card.get("classes")
    need(isinstance(classes, list) and classes and all(isinstance(c, str) and c for c in classes)
         and len(set(classes)) == len(classes), "classes", "a list of distinct class names")
    need(card.get("task") in TASKS, "task", f"one of {TASKS}")
    need(_integer(card.get("image_size"), 16, MAX_IMAGE_SIZE), "image_size", f"an integer 16..{MAX_IMAGE_SIZE}")
    need(_number(card.get("val_crop"), 0.05, 1), "val_crop", "a number in 0.05..1")
    need(card.get("cpu_decoder") in DECODERS, "cpu_decoder", f"one of {DECODERS}")
    for f, low, shown in (("mean", 0, "0..1"), ("std", STD_FLOOR, "1/255..1")):
        need(isinstance(card.get(f), list) and len(card[f]) == 3 and all(_number(x, low, 1) for x in card[f]), f,
             f"three numbers in {shown}")
    need(card.get("amp") in ("off", "fp16", "bf16"), "amp", "off, fp16 or bf16")
    need(card.get("backend", "torch") in BACKENDS, "backend", f"one of {BACKENDS}")
    for f in ("decoder", "weights"):  # older cards have neither
        need(isinstance(card.get(f, ""), str) and len(card.get(f, "")) <= 300, f, "text")
    need(card.get("zoo", "torchvision") in ("torchvision", "timm"), "zoo", "torchvision or timm")
    _check_convert(card.get("convert"), need)
    t = card.get("thresholds")
    need(t is None or (isinstance(t, list) and len(t) == len(classes) and all(_number(x, 0, 1) for x in t)),
         "thresholds", f"null or {len(classes)} numbers in 0..1")
    return card


def _check_convert(c, need) -> None:
    need(c is None or (isinstance(c, dict) and _integer(c.get("short_side"), 8, 65535)
                       and _integer(c.get("quality"), 1, 100) and _integer(c.get("max_pixels"), 1, 10**12)
                       and _number(c.get("draft_gap"), 1, 8)), "convert",
         "null or {short_side 8..65535, quality 1..100, max_pixels >= 1, draft_gap 1..8}")


def _integer(v, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _number(v, low: float, high: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high

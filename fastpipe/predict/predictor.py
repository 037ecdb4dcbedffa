"""`fastpipe.Predictor`: a trained model in your own code, with the preparation its training photos had.

    from fastpipe import Predictor
    p = Predictor("runs/leaves")                 # a run folder (best.pt), or a .onnx / .pt2 from fastpipe export
    p.predict(["new/leaf1.jpg", pil_image, jpeg_bytes])[0].label, .probability, .top_k, .scores
    x = p.transform(pil_image)                   # the exact float tensor the network sees

Each image goes through the converter's image step with the data set's settings and the validation transform of
the run (photos.prepare, cpu_ops.decode_val, then the model's normalisation): the same functions, with the same
settings, as the validation loader, so a photo gets the scores validation would give it.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastpipe.convert import images
from fastpipe.errors import DataError
from fastpipe.loaders import cpu_ops
from fastpipe.loaders.base import DeviceStep
from fastpipe.options import check_number
from fastpipe.predict.model import NON_FINITE, load_model
from fastpipe.predict.photos import prepare, settings_of
from fastpipe.util import read_regular


@dataclass(frozen=True)
class Prediction:
    label: str | list[str]  # the class (multi-label: the classes at or above their thresholds)
    probability: float | None  # the class's probability (None for multi-label)
    top_k: list[tuple[str, float]]  # the most probable classes, most probable first
    scores: dict[str, float] = field(repr=False)  # every class's probability


class Predictor:
    def __init__(self, model: str | os.PathLike, weights: str = "best", device: str | None = None,
                 max_file_size: int = 1 << 30, trust_pt2: bool = False):
        self.model = load_model(model, weights, device, trust_pt2)
        self.card, self.settings, self.limit = self.model.card, settings_of(self.model.card), max_file_size
        self.step = DeviceStep(self.model.device, self.card["mean"], self.card["std"], normalize=False)

    @property
    def classes(self) -> list[str]:
        return self.model.classes

    def inputs(self, items) -> torch.Tensor:
        """uint8 NCHW (channels_last) on the model's device: what the validation loader hands the model."""
        size, crop, decoder = self.card["image_size"], self.card["val_crop"], self.card["cpu_decoder"]
        batch = np.empty((len(items), size, size, 3), np.uint8)
        for i, item in enumerate(items):
            stored = prepare(_bytes(item, self.limit), self.settings)
            if isinstance(stored, images.Rejected):
                raise DataError(f"image {i} ({_name(item)}): {stored.reason}: {stored.detail}")
            cpu_ops.decode_val(stored, size, crop, decoder, batch[i])
        return self.step.images(torch.from_numpy(batch))

    def transform(self, image) -> torch.Tensor:
        """The float tensor (1, 3, size, size) the network sees for this image."""
        return self.model.normalized(self.inputs([image]))

    def predict(self, items, top_k: int = 3, batch_size: int = 64) -> list[Prediction]:
        """Paths, PIL images or encoded bytes (a single one, or a list) → one Prediction each."""
        check_number("top_k", top_k, int, low=1, high=MAX_TOP_K)
        check_number("batch_size", batch_size, int, low=1, high=MAX_BATCH)
        single = isinstance(items, (str, bytes, os.PathLike, Image.Image))
        items = [items] if single else list(items)
        out = []
        for start in range(0, len(items), batch_size):
            scores = self.model.scores(self.inputs(items[start : start + batch_size]))
            for i in (~torch.isfinite(scores).all(1)).nonzero().flatten().tolist():
                raise DataError(f"image {start + i} ({_name(items[start + i])}): {NON_FINITE}")
            out += [self._one(s, top_k) for s in scores.tolist()]
        return out[0] if single else out

    def _one(self, scores: list[float], top_k: int) -> Prediction:
        named = dict(zip(self.classes, scores))
        top = sorted(named.items(), key=lambda kv: -kv[1])[:top_k]
        if self.model.multilabel:
            picked = [c for c, s, t in zip(self.classes, scores, self.model.thresholds()) if s >= t]
            return Prediction(picked, None, top, named)
        return Prediction(top[0][0], top[0][1], top, named)


_PNG_MODES = {"1", "L", "LA", "I;16", "P", "RGB", "RGBA"}  # what PNG holds as it is
MAX_TOP_K, MAX_BATCH = 1000, 65536  # as `fastpipe predict --top-k / --batch-size` allow


def _bytes(item, limit: int) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, (str, os.PathLike)):
        try:
            return read_regular(Path(item), limit)
        except OSError as e:
            raise DataError(f"{item}: cannot be read ({e.strerror or e})") from None
    if isinstance(item, Image.Image):
        # Lossless, with the EXIF orientation kept; another mode (CMYK, HSV, I, RGBa...) made RGB first by the
        # converter's own rule. A JPEG's own bytes are converted with DCT scaling: pass the file or its bytes, not
        # the decoded image, for the pixels validation saw to the last grey level.
        buf = io.BytesIO()
        (item if item.mode in _PNG_MODES else images.to_rgb(item)).save(buf, "PNG", exif=item.getexif())
        return buf.getvalue()
    raise DataError(f"cannot predict a {type(item).__name__}: give file paths, PIL images or encoded image bytes")


def _name(item) -> str:
    return str(item) if isinstance(item, (str, os.PathLike)) else type(item).__name__

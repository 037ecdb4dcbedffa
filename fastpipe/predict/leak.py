"""Which photos `fastpipe predict` scores are near-copies of a photo the run trained on: their scores say what
training saw, not how the model does on new photos. The run folder's config.json names its data set; that data
set's fingerprints (its conversion's fingerprints.npz, train split) are compared with each prepared photo's (a copy
downsampled by the converter's image step is a near-copy of its original)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from fastpipe.dataset import nearcopy
from fastpipe.errors import FastpipeError
from fastpipe.util import read_json


class TrainingPhotos:
    def __init__(self, paths: list[str], fps: np.ndarray, threshold: int):
        self.paths, self.fps, self.threshold = paths, fps, threshold

    @classmethod
    def of_run(cls, model_path: str | Path) -> TrainingPhotos | None:
        """The train split's fingerprints of the run's data set; None where there are none to read (an export, a
        data set moved or converted without them)."""
        from fastpipe.convert.against import fingerprints
        from fastpipe.dataset.manifest import load

        config = Path(model_path) / "config.json"
        if not config.is_file():
            return None
        try:
            root = ((read_json(config).get("data") or {}).get("root"))
            if not isinstance(root, str) or not Path(root).is_dir():
                return None  # a store's data set is not fetched again for this note
            m = load(root)
            splits, paths, fps = fingerprints(m)
        except (FastpipeError, OSError, ValueError, AttributeError):
            return None
        train = [k for k, s in enumerate(splits) if s == "train"]
        return cls([paths[k] for k in train], fps[train], int(m.settings.get("near_threshold") or 16))

    def copies(self, prepared: list[bytes | None]) -> list[tuple[str, int] | None]:
        """For each prepared photo (stored JPEG bytes, or None), the training photo it is a near-copy of, and how
        many bits apart."""
        mine, where = [], []
        for k, data in enumerate(prepared):
            if data is None:
                continue
            try:
                mine.append(nearcopy.fingerprint(Image.open(io.BytesIO(data))))
                where.append(k)
            except (OSError, ValueError):
                continue
        out: list[tuple[str, int] | None] = [None] * len(prepared)
        if not mine or not len(self.fps):
            return out
        n = len(mine)
        for i, j, d in nearcopy.pairs(np.concatenate([np.stack(mine), self.fps]), self.threshold):
            if i < n <= j and (out[where[i]] is None or d < out[where[i]][1]):
                out[where[i]] = (self.paths[j - n], d)
        return out

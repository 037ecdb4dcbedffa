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
        self.paths, self.threshold = paths, threshold
        self.index = nearcopy.Index(fps)  # built once: each chunk of photos only asks it

    @classmethod
    def of_run(cls, model_path: str | Path) -> TrainingPhotos | None:
        """The train split's fingerprints of the run's data set; None where there are none to read (an export, a
        data set moved or converted without them)."""
        from fastpipe.convert.against import fingerprints
        from fastpipe.dataset.loading import load

        config = Path(model_path) / "config.json"
        if not config.is_file():
            return None
        try:
            root = ((read_json(config).get("data") or {}).get("root"))
            if not isinstance(root, str) or not Path(root).is_dir():
                return None  # a store's data set is not fetched again for this note
            m = load(root)
            splits, paths, fps = fingerprints(m)
            train = [k for k, s in enumerate(splits) if s == "train"]
            return cls([paths[k] for k in train], fps[train], nearcopy.threshold_of(m.settings))
        except (FastpipeError, OSError, ValueError, AttributeError):  # the note is left out, never the predictions
            return None

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
        if not mine or not self.paths:
            return out
        for k, found in zip(where, nearcopy.nearest(np.stack(mine), self.index, self.threshold)):
            out[k] = (self.paths[found[0]], found[1]) if found else None
        return out

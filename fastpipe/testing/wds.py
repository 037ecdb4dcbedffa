"""WebDataset shards as timm publishes them on the Hugging Face Hub (`imagenet-1k-wds`): a `.jpg`, a `.cls` and a
`.json` of the photo's metadata per sample, in GNU tar. For the tests and benchmarks of indexing foreign shards
where they are: photos of a realistic size (tens of KB), so that reading the headers alone is visibly less than
reading the shards."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


def timm_style_shards(folder: Path, shards: int, per_shard: int, prefix: str = "train", side: tuple = (240, 320),
                      classes: int = 3, show_class: bool = True) -> list[Path]:
    """`shards` tars of `per_shard` samples each in `folder` (PREFIX-000000.tar, ...): random photos of `side`
    (height, width), sample k of class k % classes; `show_class`: its colour channel k % 3 set to 200."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = folder / f"{prefix}-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per_shard):
                k = s * per_shard + i
                image = rng.integers(0, 256, (*side, 3), dtype=np.uint8)
                if show_class:
                    image[..., k % 3] = 200
                buf = io.BytesIO()
                Image.fromarray(image).save(buf, "JPEG", quality=90)
                meta = json.dumps({"filename": f"n{k:08d}.JPEG", "label": k % classes}).encode()
                for ext, data in (("jpg", buf.getvalue()), ("cls", str(k % classes).encode()), ("json", meta)):
                    info = tarfile.TarInfo(f"{prefix}_{k:06d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


__all__ = ["timm_style_shards"]

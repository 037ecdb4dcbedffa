"""The small files other readers need beside the shards, written from dataset.json with every data set fastpipe
writes (`shard`, `merge`, `index`, and the same into a store), so that no reader needs a file written by hand:

- `_info.json`, timm's data set info: `timm.data.create_dataset("wds/NAME", root=OUT, split="train")` refuses a
  split it does not find there. Per split: its name, samples, shard files and samples per shard.
- `wids-train.json`, `wids-val.json`: webdataset's random-access reader (wids) takes a descriptor per split,
  `{"wids_version": 1, "shardlist": [{"url", "nsamples", "filesize"}]}`. The URLs are relative: wids resolves them
  against the descriptor's own folder or URL, so the files stay right wherever the data set is copied.

The sample counts are those of the tar files (what these readers index), as the data set was written; `inspect
--repair` leaves samples out of the `.idx` files only, so these files stay as they are. Each file is a function of
the manifest alone (no path, time or host), so reruns, resumed runs and uploads give the same bytes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from fastpipe.dataset.manifest import Manifest
from fastpipe.errors import FastpipeWarning
from fastpipe.util import atomic_write_text

TIMM_INFO = "_info.json"


def wids_name(split: str) -> str:
    return f"wids-{split}.json"


def names(splits) -> list[str]:
    """The reader files a data set with these splits gets."""
    return [TIMM_INFO, *(wids_name(n) for n in splits)]


def contents(m: Manifest) -> dict[str, str]:
    """Each reader file's text, by name (splits without shards are left out: no reader can read them)."""
    splits = {n: sp for n, sp in m.splits.items() if sp.shards}
    timm = {"splits": {n: {"name": n, "num_samples": sp.samples, "filenames": [s.path for s in sp.shards],
                           "shard_lengths": [s.samples for s in sp.shards]} for n, sp in splits.items()}}
    files = {TIMM_INFO: timm}
    for n, sp in splits.items():
        files[wids_name(n)] = {"wids_version": 1, "shardlist": [
            {"url": s.path, "nsamples": s.samples, "filesize": s.bytes} for s in sp.shards]}
    return {name: json.dumps(data, indent=1, sort_keys=True) + "\n" for name, data in files.items()}


def write(m: Manifest, folder: Path, keep: set[str] = frozenset()) -> list[str]:
    """Write the reader files into `folder` (where dataset.json goes), except those named in `keep` (files of the
    user's own, which are left alone and said); returns the names written, for the manifest's `outputs`."""
    written = []
    for name, text in contents(m).items():
        if name in keep:
            warnings.warn(f"{folder / name} was not written by fastpipe: kept as it is (move it away and rerun to "
                          f"get fastpipe's)", FastpipeWarning, stacklevel=3)
            continue
        atomic_write_text(folder / name, text)
        written.append(name)
    return written


__all__ = ["TIMM_INFO", "contents", "names", "wids_name", "write"]

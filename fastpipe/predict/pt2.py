"""What a .pt2 file may hold before torch.export loads it.

torch.export's loader unpickles some entries of the archive without restriction: weights or constants the archive
marks as pickled, custom and opaque objects, legacy weight files, and sample inputs that a restricted load refuses
(it then retries unrestricted). A crafted file could run code there. fastpipe's exports hold none of these, so a file
that does is refused before torch reads it, and the sample inputs must load with weights_only=True.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import torch

from fastpipe.train.runs import RunError

CONFIG_LIMIT = 64 << 20  # bytes: the JSON configs of an archive
INPUTS_LIMIT = 256 << 20  # bytes: its sample inputs
REFUSED_DIRS = ("data/aotinductor/", "data/executorch/", "data/mtia", "xl_model_weights/")
REFUSED_PREFIXES = ("custom_obj_", "opaque_obj_")


def check_archive(path: Path) -> None:
    """Refuse (RunError naming the file and the entry) a .pt2 that holds anything loaded by unpickling."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                _check_entry(z, info, path)
    except RunError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise RunError(f"{path}: not a readable .pt2 archive ({type(e).__name__}: {str(e)[:150]}); export the model "
                       f"again") from None


def _check_entry(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> None:
    name = info.filename.split("/", 1)[-1]  # below the archive's root folder
    if name.startswith(REFUSED_DIRS) or (name.startswith(("data/weights/", "data/constants/"))
                                         and name.endswith(".pt")):
        _refuse(path, info.filename, "compiled code or a pickled payload")
    if name.startswith(("data/weights/", "data/constants/")) and name.endswith("_config.json"):
        doc = json.loads(_read(z, info, CONFIG_LIMIT, path))
        config = doc.get("config") if isinstance(doc, dict) else None
        if not isinstance(config, dict):
            _refuse(path, info.filename, "a weights or constants record of another form")
        for entry in config.values():
            if not isinstance(entry, dict) or entry.get("use_pickle") or \
                    str(entry.get("path_name", "")).startswith(REFUSED_PREFIXES):
                _refuse(path, info.filename, "a pickled weight or object")
    if name.startswith("data/sample_inputs/"):
        try:
            torch.load(io.BytesIO(_read(z, info, INPUTS_LIMIT, path)), weights_only=True)
        except Exception:  # anything but tensors and plain data: what torch would then unpickle unrestricted
            _refuse(path, info.filename, "sample inputs that only an unrestricted unpickling reads")


def _read(z: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, path: Path) -> bytes:
    if info.file_size > limit:
        _refuse(path, info.filename, f"{info.file_size} bytes, more than {limit} expected")
    return z.read(info)


def _refuse(path: Path, entry: str, what: str) -> None:
    raise RunError(f"{path}: its entry {entry} holds {what}, which loading would run as code; fastpipe's exports hold "
                   f"none: export the model again with `fastpipe export`, or use its .onnx export")

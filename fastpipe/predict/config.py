"""`fastpipe predict` and `fastpipe export` settings (no torch here: building the CLI stays light)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastpipe.errors import ConfigError
from fastpipe.loaders.config import LoaderConfig
from fastpipe.options import check, normalize_text, opt, parse_device, parse_procs
from fastpipe.store.urls import check_location

BACKENDS = ("torch", "dali", "nvjpeg")
FORMATS = ("csv", "jsonl")
WEIGHTS = ("best", "last")
EXPORT_SUFFIXES = (".onnx", ".pt2")


def _model_path(text) -> str:
    """RUN (a run folder), a checkpoint in one, or an exported model (.onnx, .pt2) on this machine."""
    text = str(text)
    check_location(text, "model")
    if "://" in text:
        raise ConfigError(f"model {text}: a run folder or an exported model on this machine (copy it here first)")
    return text


@dataclass(frozen=True)
class PredictConfig:
    model: str = opt(None, "a run folder (runs/NAME), or a model exported with `fastpipe export` (.onnx, .pt2)",
                     positional=True, flag="MODEL", parse=_model_path)
    src: list = opt([], "photos: a folder (class folders give labels), a path[,label] list, photo files, or a "
                        "store URL (s3://bucket/photos, hf://datasets/ORG/NAME/photos)", positional=True, flag="SRC",
                    nargs="+")
    out: str = opt("predictions.csv", "where the predictions go (the report and pictures beside it when SRC has "
                                      "labels)")
    format: str | None = opt(None, "csv or jsonl (default: from --out's extension, else csv)", choices=FORMATS)
    weights: str = opt("best", "a run's best.pt (best validation figure) or last.pt", choices=WEIGHTS)
    top_k: int = opt(3, "classes listed per photo, most probable first", low=1, high=1000)
    backend: str | None = opt(None, "loader backend that prepares the batches: torch, dali or nvjpeg (default: the "
                                    "one the run validated with)", choices=BACKENDS)
    device: str | None = opt(None, "cuda, cuda:N or cpu (default: cuda when available)", parse=parse_device)
    batch_size: int = opt(64, "photos per batch", low=1, high=65536)
    workers: int | None = opt(None, "processes converting the photos: a number (0 = in this process) or auto "
                                    "(every core)", parse=parse_procs, low=0, high=1024)
    max_file_size: int = opt(1024**3, "refuse larger files (bytes)", low=1, cli=False)
    trust_pt2: bool = opt(False, "load a .pt2 that `fastpipe export` did not write as this user (a .pt2 runs code "
                                 "when loaded: only one whose source you trust as a Python script's)")

    def __post_init__(self):
        check(self)
        if not self.src:
            raise ConfigError("predict needs photos: a folder, a list, photo files or a store URL after the model")

    @property
    def out_format(self) -> str:
        return self.format or ("jsonl" if Path(self.out).suffix.lower() in (".jsonl", ".json") else "csv")

    def loader(self, card: dict, backend: str, normalized: bool) -> LoaderConfig:
        """The validation transform the model was trained with, batched by `backend`: float and normalised as
        validation's (`normalized`, for a network in PyTorch), or uint8 (what an exported graph takes)."""
        return LoaderConfig(backend=backend, split="val", batch_size=self.batch_size, image_size=card["image_size"],
                            val_crop=card["val_crop"], device=self.device, num_workers=0, with_keys=True,
                            normalize=normalize_text(card["mean"], card["std"]) if normalized else False,
                            **({"cpu_decoder": card["cpu_decoder"]} if backend == "torch" else {}))


@dataclass(frozen=True)
class ExportConfig:
    run: str = opt(None, "the run folder (runs/NAME)", positional=True, flag="RUN", parse=_model_path)
    out: str = opt(None, "the file to write: NAME.onnx (ONNX) or NAME.pt2 (torch.export); NAME.EXT.json beside it",
                   positional=True, flag="OUT")
    weights: str = opt("best", "the run's best.pt (best validation figure) or last.pt", choices=WEIGHTS)

    def __post_init__(self):
        check(self)
        if Path(self.out).suffix.lower() not in EXPORT_SUFFIXES:
            raise ConfigError(f"export OUT {self.out}: the format comes from the extension, .onnx (ONNX) or .pt2 "
                              f"(torch.export); e.g. model.onnx")

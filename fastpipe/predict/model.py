"""A trained model ready to score photos, wherever it comes from: a run folder (best.pt or last.pt), a checkpoint,
or a file `fastpipe export` wrote (ONNX, run by ONNX Runtime; .pt2, by torch.export). Each takes the same input,
a uint8 RGB NCHW batch at the card's image size, and gives probabilities (softmax, or per-class sigmoid for
multi-label models), so that every runtime answers alike.

Everything read here is hostile until checked: checkpoints are loaded with weights_only (no code runs), every
model card field is checked (modelcard.py), an exported file must match the hash its JSON records.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastpipe.errors import ConfigError, MissingDependency
from fastpipe.loaders.base import DeviceStep
from fastpipe.train import modelcard
from fastpipe.train.loop import amp_dtype
from fastpipe.train.models import build_model, plain_names
from fastpipe.train.runs import Run, RunError
from fastpipe.util import read_json, read_regular

EXPORT_FORMAT, EXPORT_VERSION = "fastpipe-export", 1
NON_FINITE = "the model gave NaN or infinite scores for this photo: not a prediction"
MAX_PT2 = 16 << 30  # bytes: an exported classifier (a ViT-H is 2.5 GB)


@dataclass
class Model:
    """`scores(x)`: uint8 NCHW on `device` → probabilities (N, K), float32 on the CPU. A run's network also takes the
    float batch a loader has normalised itself (`takes_float`): the very tensor validation gave it."""

    card: dict
    device: torch.device
    source: str  # what was loaded, for messages and the report
    run: object = None  # the callable: a batch → probabilities
    notes: list[str] = field(default_factory=list)
    takes_float: bool = False  # a network in PyTorch (an exported graph takes uint8 only)

    @property
    def classes(self) -> list[str]:
        return self.card["classes"]

    @property
    def multilabel(self) -> bool:
        return self.card["task"] == "multilabel"

    def thresholds(self) -> list[float]:
        return self.card.get("thresholds") or [0.5] * len(self.classes)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """The float input the network sees for a uint8 NCHW batch (normalised as in training's validation)."""
        return DeviceStep(x.device, self.card["mean"], self.card["std"], normalize=True).finish(x)

    @torch.no_grad()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def load_model(path: str | Path, weights: str = "best", device: str | None = None, trust_pt2: bool = False) -> Model:
    """A run folder, a checkpoint (.pt), or an exported model (.onnx / .pt2 with its .json beside it). A .pt2 is
    loaded when this user's `fastpipe export` wrote it, or with trust_pt2 (it runs code: pt2.py)."""
    path = Path(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device here (`fastpipe doctor` says why); use "
                          f"--device cpu")
    if path.is_dir() or (path.suffix.lower() == ".pt" and path.is_file()):
        return _from_weights(*trained_network(path, weights), dev)
    if not path.is_file():
        raise ConfigError(f"model {path}: no such run folder or file (a run folder runs/NAME, or a .onnx/.pt2 "
                          f"file written by `fastpipe export`)")
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return _onnx(path, dev)
    if suffix == ".pt2":
        return _exported_program(path, dev, trust_pt2)
    raise ConfigError(f"model {path}: expected a run folder, a checkpoint (.pt) or an exported model (.onnx, .pt2)")


# -- a run's weights ----------------------------------------------------------------------------------------------
def _weights_file(run: Run, weights: str) -> tuple[Path, list[str]]:
    notes = []
    file = run.best_path if weights == "best" else run.checkpoint_path
    if weights == "best" and not file.exists() and run.checkpoint_path.exists():
        file = run.checkpoint_path
        notes.append(f"{run.path} has no best.pt (trained without a validation split, or before fastpipe kept "
                     f"one): using last.pt, the weights of its last saved epoch")
    if not file.exists():
        raise RunError(f"{run.path}: not a fastpipe run folder with weights (no {file.name}); give the folder "
                       f"`fastpipe train --out` wrote, or an exported model")
    return file, notes


def load_checkpoint(file: Path) -> dict:
    """A checkpoint's contents, loaded safely, or one error naming the file."""
    from fastpipe.predict.torchzip import NotTorchsZip, stored_entries

    try:
        with open(file, "rb") as f:  # torch.save's own layout: read alike by torch and zipfile, nothing inflating
            stored_entries(f, os.fstat(f.fileno()).st_size)
        state = torch.load(file, map_location="cpu", weights_only=True)
    except NotTorchsZip as e:
        raise RunError(f"{file}: not a zip archive as torch writes one ({e}): a crafted or damaged checkpoint, not "
                       f"loaded") from None
    except Exception as e:  # torch raises many types for damage (pickle, zip, EOF): all mean the same here
        raise RunError(f"{file} cannot be loaded ({type(e).__name__}: {str(e)[:200]}): a truncated, damaged or "
                       f"foreign checkpoint") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise RunError(f"{file} is not a fastpipe checkpoint (expected a dict with 'model' weights)")
    return state


def trained_network(path: str | Path, weights: str = "best") -> tuple[torch.nn.Module, dict, str, list[str]]:
    """(network on the CPU in eval mode, card, the file loaded, notes) of a run folder or a checkpoint."""
    path = Path(path)
    if path.is_dir():
        file, notes = _weights_file(Run(path), weights)
    elif path.suffix.lower() != ".pt" or not path.is_file():
        raise ConfigError(f"{path}: give a run folder (runs/NAME) or one of its checkpoints (best.pt, last.pt)")
    else:
        file, notes = path, []
    net, card, more = _checkpoint(file, path if path.is_dir() else path.parent)
    return net, card, str(file), notes + more


def _checkpoint(file: Path, run_dir: Path) -> tuple[torch.nn.Module, dict, list[str]]:
    state = load_checkpoint(file)
    card, notes = state.get("inference"), []
    if card is None:
        from fastpipe.predict.older import card_of_older_run

        card = card_of_older_run(run_dir)
    card = modelcard.check(card, str(file))
    if card["task"] == "multilabel" and state.get("kind") != "best":
        try:  # last.pt: the thresholds of its epoch's validation pass, as hostile as the rest of the card
            card = modelcard.check({**card, "thresholds": _last_thresholds(Run(run_dir), state.get("epoch"))},
                                   f"{run_dir}/metrics.jsonl")
        except (modelcard.CardError, RunError) as e:
            card = {**card, "thresholds": None}
            notes.append(f"{' '.join(str(e).split())[:300]}; using 0.5 for every class")
    return _network(card, state["model"], file).eval(), card, notes


def _from_weights(net: torch.nn.Module, card: dict, source: str, notes: list[str], device: torch.device) -> Model:
    net = net.to(device)
    if device.type == "cuda":
        net = net.to(memory_format=torch.channels_last)
    amp = card["amp"] if device.type == "cuda" else ("bf16" if card["amp"] == "bf16" else "off")
    model = Model(card, device, source, notes=notes, takes_float=True)
    multilabel = card["task"] == "multilabel"

    def run(x):
        with torch.autocast(device.type, dtype=amp_dtype(amp), enabled=amp != "off"):
            out = net(x if x.is_floating_point() else model.normalized(x)).float()
        return (out.sigmoid() if multilabel else out.softmax(1)).cpu()

    model.run = run
    return model


def _network(card: dict, weights: dict, file: Path) -> torch.nn.Module:
    """The architecture the card names, with these weights; a checkpoint that does not fit is one error, found on
    the meta device (no memory) before the network is built: a card naming a far larger model costs nothing."""
    try:
        with torch.device("meta"):
            _fit(build_model(card["model"], len(card["classes"]), card["image_size"]), weights, card, file)
        net = build_model(card["model"], len(card["classes"]), card["image_size"])
        net.load_state_dict(plain_names(weights, net))
    except RunError:
        raise
    except ConfigError as e:
        raise RunError(f"{file}: {e}") from None
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        _misfit(card, file, " ".join(str(e).split())[:200])
    return net


def _fit(skeleton: torch.nn.Module, weights: dict, card: dict, file: Path) -> None:
    """The weights have the skeleton's names and shapes, and are finite (a diverged run's give NaN for every photo)."""
    own, given = skeleton.state_dict(), plain_names(weights, skeleton)
    if set(own) != set(given):
        _misfit(card, file, f"{len(set(own) ^ set(given))} names differ, e.g. {sorted(set(own) ^ set(given))[0]}")
    for name, t in given.items():
        if not isinstance(t, torch.Tensor) or t.shape != own[name].shape:
            _misfit(card, file, f"{name} is {getattr(t, 'shape', type(t).__name__)}, expected {own[name].shape}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RunError(f"{file}: its weights hold NaN or infinity ({name}): the training diverged or the file was "
                           f"edited; use another checkpoint (--weights best or last), or train again with a lower "
                           f"learning rate")


def _misfit(card: dict, file: Path, why: str):
    raise RunError(f"{file}: its weights do not fit a {card['model']} of {len(card['classes'])} classes ({why}): an "
                   f"edited or another model's checkpoint")


def _last_thresholds(run: Run, epoch) -> list[float] | None:
    """last.pt of a multi-label run: the per-class thresholds of its epoch's validation pass (None: 0.5 each)."""
    for m in reversed(run.epochs() if run.path.is_dir() else []):
        if isinstance(m, dict) and m.get("epoch") == epoch and isinstance(m.get("per_class_threshold"), list):
            return m["per_class_threshold"]
    return None


# -- exported files -----------------------------------------------------------------------------------------------
def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sidecar(path: Path, sha256: str | None = None) -> dict:
    """The exported model's card, from the JSON beside it, checked against the file it describes (whose sha256
    the caller may have taken of the bytes it loads)."""
    meta_file = sidecar(path)
    try:
        meta = read_json(meta_file)
    except FileNotFoundError:
        raise ConfigError(f"{path}: {meta_file.name} is missing beside it (what `fastpipe export` writes with the "
                          f"model: classes, image size, preparation); copy it along with the model") from None
    except (OSError, ValueError) as e:  # ValueError: JSON, UTF-8, nesting, size (DataError)
        raise RunError(f"{meta_file} is damaged ({type(e).__name__}: {str(e)[:100]}): export the model again") \
            from None
    export = meta.get("export") if isinstance(meta, dict) else None
    if not isinstance(export, dict) or export.get("format") != EXPORT_FORMAT:
        raise RunError(f"{meta_file}: not a fastpipe export record; export the model again")
    if export.get("version") != EXPORT_VERSION:
        raise RunError(f"{meta_file}: an export of format version {str(export.get('version'))[:20]!r}; this "
                       f"fastpipe reads version {EXPORT_VERSION}: export the model again with this fastpipe")
    if export.get("sha256") != (sha256 or file_sha256(path)):
        raise RunError(f"{path} is not the file {meta_file.name} describes (its sha256 differs): a replaced or "
                       f"damaged model; export it again")
    return modelcard.check(meta.get("inference"), str(meta_file))


def _onnx(path: Path, device: torch.device) -> Model:
    card = read_sidecar(path)
    try:
        import onnxruntime as ort
    except ImportError:
        raise MissingDependency("an .onnx model runs with ONNX Runtime: pip install 'fastpipe[export]'") from None
    providers = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        session = ort.InferenceSession(str(path), providers=providers)
    except Exception as e:  # ONNX Runtime's errors have no common base: every one means the file is not usable
        raise RunError(f"{path}: ONNX Runtime cannot load it ({type(e).__name__}: {str(e)[:200]})") from None
    name = session.get_inputs()[0].name

    def run(x):
        return torch.from_numpy(session.run(None, {name: x.contiguous().cpu().numpy()})[0]).float()

    return _probed(Model(card, device, str(path), run), path)


def _exported_program(path: Path, device: torch.device, trusted: bool) -> Model:
    from fastpipe.predict import trust
    from fastpipe.predict.pt2 import check_archive

    data = read_regular(path, MAX_PT2)  # hashed, checked and loaded from these bytes: never a file swapped since
    sha256 = hashlib.sha256(data).hexdigest()
    card = read_sidecar(path, sha256)
    if not (trusted or trust.known(sha256)):
        raise RunError(f"{path}: a .pt2 holds code that torch runs when it loads the file, and this one was not "
                       f"written by `fastpipe export` as this user: load its .onnx export instead (ONNX Runtime runs "
                       f"no code from the file), or pass --trust-pt2 (Predictor(..., trust_pt2=True)) if you trust "
                       f"where it came from as you would a Python script")
    check_archive(data, path)  # a second line: the layout fastpipe export writes, nothing torch would run
    try:
        net = torch.export.load(io.BytesIO(data)).module()
    except Exception as e:  # damage shows as many error types
        raise RunError(f"{path}: torch.export cannot load it ({type(e).__name__}: {str(e)[:200]})") from None
    net = net.to(device)

    def run(x):
        return net(x.contiguous()).float().cpu()

    return _probed(Model(card, device, str(path), run), path)


def _probed(model: Model, path: Path) -> Model:
    """An exported graph, run once on one black photo: it takes the input its record describes and gives one column
    per class, or it is refused before the first photo (columns mapped to the wrong classes, or cut, otherwise)."""
    size, k = model.card["image_size"], len(model.classes)
    try:
        out = model.scores(torch.zeros(1, 3, size, size, dtype=torch.uint8, device=model.device))
    except Exception as e:  # each runtime has its own error types: all mean the graph takes other input
        raise RunError(f"{path} does not take the input its record describes (uint8 RGB, 1x3x{size}x{size}): "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:150]}; export the model again") from None
    if tuple(out.shape) != (1, k):
        raise RunError(f"{path} gives {tuple(out.shape)} for one photo where its record names {k} classes, (1, {k}): "
                       f"the model and {sidecar(path).name} do not belong together; export the model again")
    return model

"""What a .pt2 file may hold before torch.export loads it: what `fastpipe export` writes, and nothing else.

torch.export's loader runs parts of the archive as code: it unpickles weights or constants the archive marks as
pickled, custom and opaque objects, legacy weight files and sample inputs that a restricted load refuses; it hands
every shape expression to sympy, which evaluates it as Python; it resolves each node's target by attribute lookup
from the torch module (`torch.os.system` is one); it runs the graph's guards as Python source; it reads every
`extra/` entry whole. Its zip reader finds entries by name ignoring case. So the archive is checked as a whole
against the layout `fastpipe export` writes, before torch reads any of it:
- entry names: one root folder, the entries of an exported program only, no two equal but for case;
- sizes: every entry stored uncompressed (as torch writes them), so nothing inflates past the file's own size;
- the graph: targets are ATen operators (or `_operator.getitem`), shape expressions fit a grammar of symbols,
  integers and the arithmetic torch emits, and no guards;
- weights and constants: none pickled, sample inputs that load with weights_only=True.
`fastpipe export` checks its own file the same way before writing it, so every export it makes passes.
"""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

import torch

from fastpipe.train.runs import RunError
from fastpipe.util import parse_json

CONFIG_LIMIT = 64 << 20  # bytes: the JSON of an archive (a resnet50's graph is about 0.5 MB)
INPUTS_LIMIT = 256 << 20  # bytes: its sample inputs
_ENTRY = re.compile(r"(data/weights/weight_\d+|data/weights/model_weights_config\.json"
                    r"|data/constants/(tensor|constant)_\d+|data/constants/model_constants_config\.json"
                    r"|models/[A-Za-z0-9_]+\.json|data/sample_inputs/[A-Za-z0-9_]+\.pt"
                    r"|archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id)")
_TARGET = re.compile(r"torch\.ops\.aten\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+|_operator\.getitem")
# A shape expression as torch writes it (sympy's srepr: Symbol('s34', positive=True, integer=True), Mul(...)):
# sympy's constructors by name, symbol names torch makes (s0, u1...), integers and arithmetic. No attribute access,
# no indexing, no other names: nothing that evaluating it as Python could use to reach anything else.
_EXPR_TOKEN = re.compile(r"\s+|\d+|'[a-z]+\d+'|[a-z]+\d+|[A-Za-z]+|\*\*|//|[-+*/%(),=<>]")
_EXPR_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "FloorDiv", "CeilToInt",
    "FloorToInt", "CleanDiv", "PythonMod", "IntTrueDiv", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "True", "False", "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero"})


def check_archive(path: Path) -> None:
    """Refuse (RunError naming the file and the entry) a .pt2 holding anything but what `fastpipe export` writes."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            root = _check_names(infos, path)
            check_stored(infos, path)
            for info in infos:
                _check_entry(z, info, info.filename[len(root) + 1 :], path)
    except RunError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise RunError(f"{path}: not a readable .pt2 archive ({type(e).__name__}: {str(e)[:150]}); export the model "
                       f"again") from None


def _check_names(infos: list[zipfile.ZipInfo], path: Path) -> str:
    roots = {i.filename.split("/", 1)[0] for i in infos}
    if len(roots) != 1:
        _refuse(path, ", ".join(sorted(roots)[:3]), "several root folders")
    (root,) = roots
    seen: dict[str, str] = {}
    for info in infos:
        folded = info.filename.casefold()
        if folded in seen:  # torch's reader would take either, whichever this check did not read
            _refuse(path, info.filename, f"a name equal to {seen[folded]} but for case")
        seen[folded] = info.filename
        if not _ENTRY.fullmatch(info.filename[len(root) + 1 :]):
            _refuse(path, info.filename, "an entry of another kind than an exported program's")
    return root


def check_stored(infos: list[zipfile.ZipInfo], path: Path) -> None:
    """Entries as torch writes them (.pt2 and checkpoints alike): stored, their sizes within the file's own, so that
    no entry inflates to more than the file holds, whatever reads it."""
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            _not_torchs(path, info.filename, f"compressed ({info.file_size} bytes once inflated)")
    if sum(i.file_size for i in infos) > path.stat().st_size:
        _not_torchs(path, infos[0].filename, "larger than the file with the others")


def _not_torchs(path: Path, entry: str, what: str):
    raise RunError(f"{path}: its entry {entry} is {what}; torch writes its files uncompressed: a crafted or damaged "
                   f"file, not loaded")


def _check_entry(z: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, path: Path) -> None:
    if name.startswith(("data/weights/", "data/constants/")) and name.endswith("_config.json"):
        _check_tensor_config(parse_json(_read(z, info, CONFIG_LIMIT, path)), info, path)
    elif name.startswith("models/"):
        _check_graph(parse_json(_read(z, info, CONFIG_LIMIT, path)), info, path)
    elif name.startswith("data/sample_inputs/"):
        try:
            torch.load(io.BytesIO(_read(z, info, INPUTS_LIMIT, path)), weights_only=True)
        except Exception:  # anything but tensors and plain data: what torch would then unpickle unrestricted
            _refuse(path, info.filename, "sample inputs that only an unrestricted unpickling reads")


def _check_tensor_config(doc, info: zipfile.ZipInfo, path: Path) -> None:
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        _refuse(path, info.filename, "a weights or constants record of another form")
    for entry in config.values():
        if not isinstance(entry, dict) or entry.get("use_pickle") is not False or \
                not re.fullmatch(r"(weight|tensor|constant)_\d+", str(entry.get("path_name"))):
            _refuse(path, info.filename, "a pickled weight or object")


def _check_graph(doc, info: zipfile.ZipInfo, path: Path) -> None:
    """Every target, shape expression and guard anywhere in the program (subgraphs included), without recursion."""
    if not isinstance(doc, dict) or doc.get("guards_code", []) != []:
        _refuse(path, info.filename, "guards (Python source torch runs)")
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if key == "target" and isinstance(value, str) and not _TARGET.fullmatch(value):
                _refuse(path, info.filename, f"a call of {value[:80]!r}, not an ATen operator")
            if key == "expr_str" and not _plain_expression(value):
                _refuse(path, info.filename, f"a shape expression that is not arithmetic ({str(value)[:80]!r})")
            stack.append(value)


def _plain_expression(text) -> bool:
    if not isinstance(text, str) or len(text) > 4096:
        return False
    pos = 0
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None or (m.group()[0].isalpha() and not re.fullmatch(r"[a-z]+\d+", m.group())
                         and m.group() not in _EXPR_NAMES):
            return False
        pos = m.end()
    return True


def _read(z: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, path: Path) -> bytes:
    if info.file_size > limit:
        _refuse(path, info.filename, f"{info.file_size} bytes, more than {limit} expected")
    return z.read(info)


def _refuse(path: Path, entry: str, what: str) -> None:
    raise RunError(f"{path}: its entry {entry} holds {what}, which loading would run as code or could not be "
                   f"checked; fastpipe's exports hold none: export the model again with `fastpipe export`, or use "
                   f"its .onnx export, the format to receive models in from others")

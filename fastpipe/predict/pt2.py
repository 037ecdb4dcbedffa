"""What a .pt2 file may hold before torch.export loads it: what `fastpipe export` writes, and nothing else.

A .pt2 is code as much as data: torch.export's loader unpickles weights or constants the archive marks as pickled,
custom and opaque objects, legacy weight files and sample inputs that a restricted load refuses; it hands every
shape expression to sympy, which evaluates it as Python; it resolves node targets and operator arguments by
attribute lookup from the torch module; it builds guards as Python source from the graph's inputs and runs them;
its zip reader finds entries by name ignoring case, and reads the archive otherwise than Python's zipfile where the
layout allows it. So fastpipe loads a .pt2 only when this user's `fastpipe export` wrote it (trust.py), or when the
user says they trust it; and, before torch reads any of it, checks the whole archive against the layout `fastpipe
export` writes (a second line of defence, not a proof that a crafted file is harmless):
- the zip laid out as torch writes one, every entry stored (torchzip.py);
- entry names: one root folder, the entries of an exported program only, no two equal but for case;
- the graph: ATen operators (or `_operator.getitem`) as targets, no operator, string, graph or object arguments,
  one tensor input, shape expressions of symbols, integers and + - * // only, bounded ranges, no guards;
- weights and constants: none pickled; sample inputs stored the same way and loadable with weights_only=True.
`fastpipe export` checks its own file the same way before writing it, so every export it makes passes.
"""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

import torch

from fastpipe.predict.torchzip import NotTorchsZip, stored_entries_of
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
# No power (10**10**10 is a CPU and memory bomb sympy evaluates), integers of at most 12 digits.
_EXPR_TOKEN = re.compile(r"\s+|\d{1,12}(?!\d)|'[a-z]\d{1,6}'|[a-z]\d{1,6}(?![\w])|[A-Za-z]+|//|[-+*(),=]")
_EXPR_NAMES = frozenset({
    "Symbol", "Integer", "Add", "Mul", "Max", "Min", "FloorDiv", "CeilToInt", "FloorToInt", "CleanDiv", "Eq", "Ne",
    "True", "False", "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero"})
_REFUSED_KEYS = frozenset({"as_string", "as_strings", "as_operator", "as_graph", "as_custom_obj", "constant_input",
                           "as_sym_float", "as_sym_floats", "as_complex"})


def check_archive(data: bytes, path: Path) -> None:
    """Refuse (RunError naming the file and the entry) a .pt2, given as its bytes, holding anything but what
    `fastpipe export` writes."""
    try:
        infos = stored_entries_of(data)
        root = _check_names(infos, path)
        sizes = {i.filename[len(root) + 1 :]: i.file_size for i in infos}
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in infos:
                _check_entry(z, info, info.filename[len(root) + 1 :], path, sizes)
    except RunError:
        raise
    except NotTorchsZip as e:
        _not_torchs(path, str(e))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RecursionError) as e:
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


def _not_torchs(path: Path, what: str):
    raise RunError(f"{path}: not a zip archive as torch writes one ({what[:200]}): a crafted or damaged file, not "
                   f"loaded")


def _check_entry(z: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, path: Path, sizes: dict[str, int]) -> None:
    if name.startswith(("data/weights/", "data/constants/")) and name.endswith("_config.json"):
        folder = name.rsplit("/", 1)[0]
        _check_tensor_config(parse_json(_read(z, info, CONFIG_LIMIT, path)), info, path,
                             {k.rsplit("/", 1)[1]: v for k, v in sizes.items() if k.rsplit("/", 1)[0] == folder})
    elif name.startswith("models/"):
        _check_graph(parse_json(_read(z, info, CONFIG_LIMIT, path)), info, path)
    elif name.startswith("data/sample_inputs/"):
        inputs = _read(z, info, INPUTS_LIMIT, path)
        try:
            stored_entries_of(inputs)  # a torch.save zip itself: none of its entries may inflate either
            torch.load(io.BytesIO(inputs), weights_only=True)
        except Exception:  # anything but tensors and plain data: what torch would then unpickle unrestricted
            _refuse(path, info.filename, "sample inputs that only an unrestricted unpickling reads")


def _check_tensor_config(doc, info: zipfile.ZipInfo, path: Path, stored: dict[str, int]) -> None:
    """No pickles; each tensor no larger than its entry (torch makes the tensor its record describes, zeros where the
    entry is empty, before it reads a byte)."""
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        _refuse(path, info.filename, "a weights or constants record of another form")
    for entry in config.values():
        if not isinstance(entry, dict) or entry.get("use_pickle") is not False or \
                not re.fullmatch(r"(weight|tensor|constant)_\d+", str(entry.get("path_name"))):
            _refuse(path, info.filename, "a pickled weight or object")
        need = _tensor_bytes(entry.get("tensor_meta"))
        if need is None or need > stored.get(entry["path_name"], -1):
            _refuse(path, info.filename, f"a tensor larger than its entry {entry['path_name']} (or of a kind an "
                                         f"export of an image classifier has none of)")


_ITEM_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 2, 7: 4, 8: 8, 12: 1, 13: 2}  # torch.export's ScalarType codes


def _tensor_bytes(meta) -> int | None:
    """Bytes a tensor_meta's storage spans (offset and strides included), or None for one of another form."""
    try:
        dims = [d["as_int"] for d in meta["sizes"]]
        strides = [d["as_int"] for d in meta["strides"]]
        offset, item = meta["storage_offset"]["as_int"], _ITEM_BYTES[meta["dtype"]]
    except (KeyError, TypeError):
        return None
    if len(dims) != len(strides) or not all(type(x) is int and 0 <= x < 2**40 for x in (*dims, *strides, offset)):
        return None
    return 0 if 0 in dims else (offset + 1 + sum((n - 1) * s for n, s in zip(dims, strides))) * item


def _check_graph(doc, info: zipfile.ZipInfo, path: Path) -> None:
    """Every target, argument, shape expression and guard anywhere in the program (subgraphs included), without
    recursion; its inputs and range constraints."""
    if not isinstance(doc, dict) or doc.get("guards_code", []) != []:
        _refuse(path, info.filename, "guards (Python source torch runs)")
    _check_signature(doc, info, path)
    _check_ranges(doc.get("range_constraints"), info, path)
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if key == "target" and isinstance(value, str) and not _TARGET.fullmatch(value):
                _refuse(path, info.filename, f"a call of {value[:80]!r}, not an ATen operator")
            if key == "expr_str" and not _plain_expression(value):
                _refuse(path, info.filename, f"a shape expression that is not arithmetic ({str(value)[:80]!r})")
            if key in _REFUSED_KEYS:
                _refuse(path, info.filename, f"an argument of kind {key} (an export of an image classifier has none)")
            stack.append(value)


def _check_signature(doc: dict, info: zipfile.ZipInfo, path: Path) -> None:
    """Parameters, buffers and tensor constants, and one user input (the images): a string input would become
    guard source torch runs."""
    specs = ((doc.get("graph_module") or {}).get("signature") or {}).get("input_specs")
    kinds = [next(iter(s), None) if isinstance(s, dict) and len(s) == 1 else None for s in specs or [None]]
    if any(k not in ("parameter", "buffer", "tensor_constant", "user_input") for k in kinds) or \
            kinds.count("user_input") != 1:
        _refuse(path, info.filename, f"inputs other than one batch of images ({', '.join(map(str, kinds))[:80]})")


def _check_ranges(ranges, info: zipfile.ZipInfo, path: Path) -> None:
    def bounded(v) -> bool:
        return isinstance(v, dict) and all(type(v.get(b)) is int and abs(v[b]) <= 2**63 for b in ("min_val", "max_val"))

    ok = isinstance(ranges, dict) and len(ranges) <= 64 and all(
        isinstance(k, str) and re.fullmatch(r"[a-z]\d{1,6}", k) and bounded(v) for k, v in ranges.items())
    if not ok:
        _refuse(path, info.filename, "range constraints of another form than a batch size's")


def _plain_expression(text) -> bool:
    if not isinstance(text, str) or len(text) > 4096 or "**" in re.sub(r"\s", "", text):  # a power: refused
        return False
    pos = 0
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None or (m.group()[0].isalpha() and not re.fullmatch(r"[a-z]\d{1,6}", m.group())
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

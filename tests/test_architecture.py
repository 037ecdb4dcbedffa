"""The layering docs/ARCHITECTURE.md describes, checked: each layer imports only its own and those below it (the
ground floor, then store/, then dataset/, then the feature packages), the converter and the loaders never import
each other, nothing but those layers sits at the top of the package, and no module grows past 350 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "fastpipe"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "fastpipe":  # from fastpipe.store import cachefiles
            found |= {f"fastpipe.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("fastpipe")}


@pytest.mark.parametrize("package,forbidden", [("convert", "fastpipe.loaders"), ("loaders", "fastpipe.convert"),
                                               ("loaders", "fastpipe.train"), ("convert", "fastpipe.train"),
                                               *((p, up) for p in ("convert", "loaders", "train")
                                                 for up in ("fastpipe.predict", "fastpipe.bench")),
                                               ("predict", "fastpipe.bench"), ("bench", "fastpipe.predict")])
def test_layers_do_not_import_upwards_or_sideways(package, forbidden):
    bad = {p.name: sorted(m for m in imports(p) if m.startswith(forbidden)) for p in (PKG / package).glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


# each layer and what it may import of fastpipe (besides itself)
LAYERS = {
    "ground": ({"errors.py", "util.py", "options.py"}, {"fastpipe.errors", "fastpipe.util", "fastpipe.options"}),
    "store": ({"store"}, {"fastpipe.errors", "fastpipe.util", "fastpipe.options", "fastpipe.store"}),
    "dataset": ({"dataset"}, {"fastpipe.errors", "fastpipe.util", "fastpipe.options", "fastpipe.store",
                              "fastpipe.dataset"}),
}


def _files(where: set[str]) -> list[Path]:
    return [p for w in where for p in ([PKG / w] if w.endswith(".py") else (PKG / w).glob("*.py"))]


@pytest.mark.parametrize("layer", LAYERS)
def test_the_lower_layers_import_only_what_lies_below(layer):
    where, allowed = LAYERS[layer]
    bad = {p.relative_to(PKG).as_posix(): sorted(m for m in imports(p) if not any(
        m == a or m.startswith(a + ".") for a in allowed)) for p in _files(where)}
    assert not {k: v for k, v in bad.items() if v}


def test_the_top_of_the_package_holds_only_the_layers_and_the_commands():
    loose = {p.name for p in PKG.glob("*.py")}
    assert loose == {"__init__.py", "__main__.py", "cli.py", "doctor.py", "errors.py", "util.py", "options.py"}


def test_the_store_writer_calls_neither_merge_nor_index():
    """publish.py (staging and upload) is what merge.py and foreign.py use to write into a store: one way only."""
    assert not imports(PKG / "convert" / "publish.py") & {"fastpipe.convert.merge", "fastpipe.convert.foreign"}
    assert "fastpipe.convert.publish" in imports(PKG / "convert" / "merge.py") & imports(PKG / "convert" / "foreign.py")


def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 350}
    assert not long

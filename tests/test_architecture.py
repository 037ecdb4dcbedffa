"""The layering docs/ARCHITECTURE.md describes, checked: the converter and the loaders never import each other,
the ground floor imports neither, and no module grows past 350 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "fastpipe"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "fastpipe":  # from fastpipe import cachefiles
            found |= {f"fastpipe.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("fastpipe")}


@pytest.mark.parametrize("package,forbidden", [("convert", "fastpipe.loaders"), ("loaders", "fastpipe.convert"),
                                               ("loaders", "fastpipe.train"), ("convert", "fastpipe.train")])
def test_layers_do_not_import_upwards_or_sideways(package, forbidden):
    bad = {p.name: sorted(m for m in imports(p) if m.startswith(forbidden)) for p in (PKG / package).glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_the_ground_floor_imports_no_feature_package():
    for name in ("errors.py", "util.py", "options.py", "shardformat.py", "manifest.py", "storage.py", "cache.py",
                 "cachefiles.py", "stores.py", "imageguard.py"):
        mods = imports(PKG / name)
        assert not [m for m in mods if m.split(".")[1] in ("convert", "loaders", "train", "bench", "cli")], name


def test_the_store_writer_calls_neither_merge_nor_index():
    """publish.py (staging and upload) is what merge.py and foreign.py use to write into a store: one way only."""
    assert not imports(PKG / "convert" / "publish.py") & {"fastpipe.convert.merge", "fastpipe.convert.foreign"}
    assert "fastpipe.convert.publish" in imports(PKG / "convert" / "merge.py") & imports(PKG / "convert" / "foreign.py")


def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 350}
    assert not long

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
    """publish.py (staging and upload) is what merge.py and adopt.py (index in a store) use to write into a store:
    one way only."""
    assert not imports(PKG / "convert" / "publish.py") & {"fastpipe.convert.merge", "fastpipe.convert.adopt"}
    assert "fastpipe.convert.publish" in imports(PKG / "convert" / "merge.py") & imports(PKG / "convert" / "adopt.py")


def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 350}
    assert not long


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imported_modules(path: Path) -> set[str]:
    """The fastpipe modules `path` imports, `from fastpipe.loaders import stream` read as fastpipe.loaders.stream."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastpipe"):
            base = PKG.parent.joinpath(*node.module.split("."))
            subs = {f"{node.module}.{a.name}" for a in node.names if any(base.glob(f"{a.name}.*"))
                    or (base / a.name).is_dir()}  # a module, the C extension, or a package
            found |= subs or {node.module}
            found |= {node.module} if len(subs) < len(node.names) else set()
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fastpipe")}
    return found


def test_no_import_circle():
    """No module reaches itself through imports, those inside functions included (an import moved into a function
    hides a circle; it does not remove it). A package's __init__ counts as the package."""
    graph = {_module(p): _imported_modules(p) for p in PKG.rglob("*.py")}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    circles = []

    def visit(m: str, path: list[str], seen: set[str]):
        for d in sorted(graph[m]):
            if d == path[0]:
                circles.append(" -> ".join([*path, d]))
            elif d not in seen and d > path[0]:  # each circle once, from its smallest module
                seen.add(d)
                visit(d, [*path, d], seen)

    for m in sorted(graph):
        visit(m, [m], {m})
    assert not circles, "\n".join(circles[:20])


def test_only_the_store_layer_tells_a_url_from_a_local_path():
    """Every other module takes a location (store/location.open_location) or asks one: no second opinion on what a
    URL is, and no store-or-folder attribute on a data set (`Manifest.files` is a location, whatever it is)."""
    asking = {}
    for path in PKG.rglob("*.py"):
        if "store" in path.relative_to(PKG).parts:
            continue
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        found = ({"is_url", "URL_RE"} & (names | attrs)) | ({"remote"} & attrs if "ray" not in path.name else set())
        if found:
            asking[path.relative_to(PKG).as_posix()] = sorted(found)
    assert asking == {}

"""The commands the README and the guide pages show exist with the flags they show: each `fastpipe ...` line of
their code blocks is parsed by the CLI's own parser (nothing is run)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)


def commands(page: Path) -> list[str]:
    found = []
    for block in BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            line = re.sub(r"^(torchrun|python -m)\b.*?-m fastpipe", "fastpipe", line)  # torchrun ... -m fastpipe
            if line.startswith("fastpipe "):
                found.append(line)
    return found


def test_the_readme_tour_and_each_job_show_their_commands():
    shown = {line.split()[1] for line in commands(ROOT / "README.md")}
    assert {"doctor", "demo-data", "shard", "inspect", "train", "runs", "bench", "memory", "predict", "export"} <= shown


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page, capsys):
    from fastpipe.cli import build_parser

    parser = build_parser()
    for line in commands(page):
        argv = shlex.split(line.replace("$TASK_ID", "0"))[1:]
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.name}: `{line}` does not parse: {capsys.readouterr().err.strip()[-300:]}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_example_shown_parses_and_imports_what_exists(page):
    """Each ```python block is Python, and every name it imports from fastpipe is there."""
    import ast
    import importlib

    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        try:
            tree = ast.parse(block)
        except SyntaxError as e:
            pytest.fail(f"{page.name}: an example is not Python ({e.msg}, line {e.lineno}):\n{block}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastpipe":
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page.name}: `from {node.module} import {', '.join(missing)}` fails"

"""The data card (README.md) uploaded with a converted set to the Hugging Face Hub: what is in it (classes, counts per
split, mean/std, how it was made) and how to read it with fastpipe, webdataset and Hugging Face `datasets`. Its
YAML header tells the Hub's viewer and `datasets.load_dataset` which shards form each split.

Written only for a set at the root of its repository (the Hub reads a card there only) whose shards are in it (not
an index of someone else's shards, `index --out`), and only where the repository has no README.md: a card the owner
wrote is theirs (a card fastpipe wrote ends with CARD_MARK, and is rewritten).
"""

from __future__ import annotations

import re

from fastpipe.store.hub import endpoint, parts

SPLIT_NAMES = {"train": "train", "val": "validation"}  # the names `datasets` and the Hub's viewer expect
# The card's last line: a conversion rewrites a card that holds it; delete the line to keep your own edits
CARD_MARK = "<!-- written by fastpipe from dataset.json: a conversion rewrites it; delete this line to keep edits -->"


def card(manifest: dict, url: str) -> str | None:
    """The card's text, or None where none is written (see the module's docstring)."""
    repo, revision, folder = parts(url)
    if folder or (manifest.get("settings") or {}).get("shards_at"):
        return None
    prefix = ""
    splits = {name: sp for name, sp in manifest.get("splits", {}).items() if sp.get("shards")}
    header = ["---", "task_categories:", "- image-classification", "tags:", "- webdataset", "- fastpipe",
              "configs:", "- config_name: default", "  data_files:"]
    for name in splits:
        header += [f"  - split: {SPLIT_NAMES.get(name, name)}", f'    path: "{prefix}{name}-*.tar"']
    header.append("---")
    return "\n".join([*header, "", *_contents(manifest, repo, splits), "", *_reading(url, repo, revision, prefix,
                                                                                    splits), "", CARD_MARK]) + "\n"


def _contents(manifest: dict, repo: str, splits: dict) -> list[str]:
    classes = list(manifest.get("classes", []))
    settings = manifest.get("settings", {})
    total = sum(sp.get("samples", 0) for sp in splits.values())
    lines = [f"# {repo.split('/')[-1]}", "",
             f"{total} photos of {len(classes)} classes, converted by fastpipe: RGB JPEGs with a short side of "
             f"{settings.get('short_side', '?')} px at quality {settings.get('quality', '?')}, in WebDataset tar "
             f"shards (`.jpg` the photo, `.cls` the class index), each with a DALI `.idx` index. `dataset.json` "
             f"holds the classes, counts, mean/std and class weights; `rejected.jsonl` the files left out and why.",
             "", "| class | " + " | ".join(splits) + " |", "|---|" + "---|" * len(splits)]
    for k, name in enumerate(classes):
        counts = [sp.get("class_counts", [])[k] if k < len(sp.get("class_counts", [])) else "" for sp in
                  splits.values()]
        lines.append(f"| {_cell(name)} | " + " | ".join(map(str, counts)) + " |")
    if manifest.get("mean") and manifest.get("std"):
        lines += ["", "Mean and standard deviation of the training photos (RGB, 0 to 1): "
                      f"mean {_three(manifest['mean'])}, std {_three(manifest['std'])}."]
    return lines


def _reading(url: str, repo: str, revision: str | None, prefix: str, splits: dict) -> list[str]:
    first = next(iter(splits), "train")
    shards = [s["path"] for s in splits.get(first, {}).get("shards", [])]
    numbered = [re.fullmatch(r"(.*-)(\d+)\.tar", p) for p in shards]
    if shards and all(numbered) and [int(m[2]) for m in numbered] == list(range(int(numbered[0][2]), len(shards) +
                                                                                int(numbered[0][2]))):
        braces = f"{numbered[0][1]}{{{numbered[0][2]}..{numbered[-1][2]}}}.tar"  # train-{000000..000007}.tar
    else:
        braces = shards[0] if shards else f"{first}.tar"
    return ["## Read it", "", "With fastpipe (`pip install 'fastpipe[hf]'`):", "", "```python",
            "from fastpipe import make_loader", "",
            f'loader = make_loader("{url}", split="{first}", batch_size=64, image_size=224)', "```", "",
            "With webdataset:", "", "```python", "import webdataset as wds", "",
            f'url = "{endpoint() or "https://huggingface.co"}/datasets/{repo}/resolve/{revision or "main"}/{prefix}'
            f'{braces}"  # a private repository: add a header, Authorization: Bearer HF_TOKEN',
            'data = wds.WebDataset(url).decode("pil").to_tuple("jpg", "cls")', "```", "",
            "With Hugging Face `datasets`:", "", "```python", "from datasets import load_dataset", "",
            f'data = load_dataset("{repo}", split="{SPLIT_NAMES.get(first, first)}", streaming=True)', "```"]


def _cell(name: str) -> str:
    return str(name).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _three(values) -> str:
    return "(" + ", ".join(f"{float(v):.3f}" for v in values) + ")"


__all__ = ["CARD_MARK", "card"]

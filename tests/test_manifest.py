"""dataset.json is validated in one place at load: a damaged or hostile manifest is one clear ManifestError, and the
loader checks the `.idx` files against it before any worker starts."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from fastpipe import make_loader
from fastpipe.convert.inspect import inspect
from fastpipe.dataset.loading import load
from fastpipe.dataset.manifest import ManifestError
from fastpipe.errors import DataError
from fastpipe.loaders.shards import ShardError


@pytest.fixture
def copy_of(converted, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(converted, out)
    return out


def edit(out, change) -> None:
    d = json.loads((out / "dataset.json").read_text())
    change(d)
    (out / "dataset.json").write_text(json.dumps(d))


def first_shard(d):
    return d["splits"]["train"]["shards"][0]


@pytest.mark.parametrize("change,match", [
    (lambda d: first_shard(d).update(path="../../etc/passwd"), r"shards\[0\]\.path .*inside the data set"),
    (lambda d: first_shard(d).update(path="/etc/passwd"), r"shards\[0\]\.path .*inside the data set"),
    (lambda d: first_shard(d).update(index="../x.idx"), r"shards\[0\]\.index"),
    (lambda d: first_shard(d).update(samples="12"), r"shards\[0\]\.samples should be an integer"),
    (lambda d: first_shard(d).update(samples=-3), r"shards\[0\]\.samples should be an integer >= 0"),
    (lambda d: first_shard(d).update(sha256=5), r"sha256"),
    (lambda d: (d["splits"]["train"]["shards"].append(copy.deepcopy(first_shard(d))),
                d["splits"]["train"]["class_counts"].__setitem__(0, d["splits"]["train"]["class_counts"][0]
                                                                 + first_shard(d)["samples"])), "listed twice"),
    (lambda d: d["splits"]["train"].update(class_counts=[1, 2]), "a list of 3 counts"),
    (lambda d: d["splits"]["train"].update(class_counts=[1, 2, 3]), "adding up"),
    (lambda d: d.update(classes="red"), "classes should be a list"),
    (lambda d: d.update(classes=["a", "a", "b"]), "distinct"),
    (lambda d: d.update(splits=[]), "splits should be"),
    (lambda d: d.update(splits={"test": {}}), "splits should be"),
    (lambda d: d["stats"].update(pixels=0), r"stats\.pixels should be above 0"),
    (lambda d: d["stats"].update(sum=[1, 2]), r"stats\.sum"),
    (lambda d: d["stats"].update(sumsq=[1, "x", 3]), r"stats\.sumsq"),
    (lambda d: d.update(stats=None), "stats should be"),
    (lambda d: d.update(components={"image": "jpg x"}), "components"),
    (lambda d: d.update(components={"color": "red"}), "components"),
    (lambda d: d["outputs"]["previews"].update(red="../../x.jpg"), "previews"),
    (lambda d: d.update(version=99), "newer than this fastpipe"),
    (lambda d: d.update(mean=[0.485, 0.456, 0.406]), "mean should be what its stats give .*hand edit.*--normalize"),
    (lambda d: d.update(std=[0.229, 0.224, 0.225]), "std should be what its stats give"),
    (lambda d: d.update(mean="imagenet"), "mean should be"),
])
def test_a_hostile_or_damaged_manifest_is_one_clear_error(copy_of, change, match):
    edit(copy_of, change)
    with pytest.raises(ManifestError, match=match):
        load(copy_of)


def test_a_wrong_sample_count_is_caught_at_loader_construction(copy_of):
    def change(d):
        first_shard(d)["samples"] -= 1
        d["splits"]["train"]["class_counts"][0] -= 1

    edit(copy_of, change)
    with pytest.raises(ShardError, match=r"lists \d+ samples but .* says"):
        make_loader(copy_of, "torch", batch_size=4, image_size=32, device="cpu", num_workers=0)


def test_a_damaged_index_is_caught_at_loader_construction(copy_of):
    m = load(copy_of)
    idx = copy_of / m.splits["train"].shards[1].index
    idx.write_text(idx.read_text().replace("jpg", "jpg 12", 1))
    with pytest.raises(DataError, match=rf"{idx.name}, line 2.*--idx-only"):
        make_loader(copy_of, "torch", batch_size=4, image_size=32, device="cpu", num_workers=2)


def test_labels_beyond_the_class_list_are_found_by_verify_and_stop_the_loader(copy_of):
    def two_classes(d):  # the shards hold labels 0-2; the manifest now claims two classes
        d["classes"] = ["red", "green"]
        for sp in d["splits"].values():
            sp["class_counts"] = [sum(sp["class_counts"]), 0]

    edit(copy_of, two_classes)
    m = load(copy_of)
    report = inspect(copy_of, verify=True)
    assert not report.ok and any("outside the 2 classes" in b["reason"] for b in report.bad)
    loader = make_loader(copy_of, "torch", batch_size=4, image_size=32, device="cpu", num_workers=0)
    with pytest.raises(DataError, match=r"label 2 is outside the 2 classes"):
        list(loader)
    assert m.num_classes == 2


def test_a_manifest_nested_too_deep_is_one_clear_error(copy_of):
    """json.loads recurses once per level: a file nested 100,000 deep would end in a RecursionError."""
    from fastpipe.util import parse_json

    (copy_of / "dataset.json").write_text('{"classes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ManifestError, match="nested more than 100 levels deep"):
        load(copy_of)
    # brackets inside strings, escaped quotes among them, are text: a shallow document parses
    text = json.dumps({"name": "[[[" * 200 + '"\\' + "{" * 300, "deep": [[[1]]]})
    assert parse_json(text)["deep"] == [[[1]]] and parse_json(text.encode()) == json.loads(text)

"""Data sets on the Hugging Face Hub (hf://datasets/ORG/NAME): written as one commit with a data card, read by every
command that reads a store, the token never written or printed. Against a loopback server that answers the Hub's
HTTP API as huggingface_hub calls it (fastpipe/testing/hubserver.py), selected with HF_ENDPOINT."""

from __future__ import annotations

import sys

import pytest
from conftest import epoch, make_folder, tree

pytest.importorskip("huggingface_hub")

from fastpipe import make_loader
from fastpipe.cli import main
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.errors import ConfigError
from fastpipe.store.urls import check_url, redact
from fastpipe.testing.hubserver import Hub, serve_hub

TOKEN = "hf_fastpipeTestTokenDoNotPrint0123"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub on loopback that wants TOKEN for every request, with an empty data set repository org/leafs."""
    state = Hub(token=TOKEN)
    state.create("org/leafs")
    server, endpoint = serve_hub(state)
    for k, v in {"HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf-home"),
                 "FASTPIPE_CACHE": str(tmp_path / "cache" / "shards"), "FASTPIPE_REMOTE_ATTEMPTS": "2"}.items():
        monkeypatch.setenv(k, v)
    yield state
    server.shutdown()
    server.server_close()


SETTINGS = dict(short_side=64, val_fraction=0.25, max_shard_size=64 * 1024, workers=1)


def test_a_set_sharded_into_the_hub_is_one_commit_with_a_card_and_reads_as_the_local_one(hub, tmp_path):
    src = make_folder(tmp_path / "src", {"red": 14, "green": 10, "blue": 6}, size=(120, 90))
    shard(ShardConfig(src, tmp_path / "local", **SETTINGS))
    shard(ShardConfig(src, "hf://datasets/org/leafs", **SETTINGS))
    repo = hub.repos["org/leafs"]
    assert repo.commits == ["initial commit", f"fastpipe: a converted data set ({len(repo.files) - 1} files)"]
    local = tree(tmp_path / "local")
    assert {k: v for k, v in repo.files.items() if k.endswith((".tar", ".idx"))} == \
        {k: v for k, v in local.items() if k.endswith((".tar", ".idx"))}  # the same bytes as a local conversion
    card = repo.files["README.md"].decode()
    import yaml

    header = yaml.safe_load(card.split("---")[1])
    assert header["configs"][0]["data_files"] == [{"split": "train", "path": "train-*.tar"},
                                                   {"split": "validation", "path": "val-*.tar"}]
    assert "| red |" in card and 'make_loader("hf://datasets/org/leafs"' in card
    ours = epoch(make_loader(tmp_path / "local", batch_size=4, image_size=32, with_keys=True, num_workers=0))
    theirs = epoch(make_loader("hf://datasets/org/leafs", batch_size=4, image_size=32, with_keys=True,
                               num_workers=0))
    assert ours[0] == theirs[0] and ours[1] == theirs[1] and (ours[2] == theirs[2]).all()


def test_the_owners_card_is_kept_and_a_revision_is_read(hub, tmp_path):
    hub.repos["org/leafs"].files["sets/v1/README.md"] = b"# our own card\n"
    shard(ShardConfig(make_folder(tmp_path / "src", {"red": 6, "blue": 6}), "hf://datasets/org/leafs/sets/v1",
                      **SETTINGS))
    assert hub.repos["org/leafs"].files["sets/v1/README.md"] == b"# our own card\n"
    assert "sets/v1/dataset.json" in hub.repos["org/leafs"].files
    assert main(["inspect", "hf://datasets/org/leafs@main/sets/v1", "--verify"]) == 0


def test_the_token_never_reaches_a_file_or_a_message(hub, tmp_path, capsys):
    """Every command over hf:// with the token in HF_TOKEN: nothing under the working folders, the cache or the
    run holds it, nor anything printed, and every request to the Hub carried it."""
    src = make_folder(tmp_path / "src", {"red": 8, "green": 8}, size=(120, 90))
    url = "hf://datasets/org/leafs"
    assert main(["shard", str(src), url, "--short-side", "48", "--workers", "1"]) == 0
    assert main(["inspect", url, "--verify"]) == 0
    assert main(["train", url, "--model", "resnet18", "--epochs", "1", "--batch-size", "4", "--image-size", "32",
                 "--device", "cpu", "--out", str(tmp_path / "run"), "--workers", "0"]) == 0
    assert main(["predict", str(tmp_path / "run"), url, "--out", str(tmp_path / "answers")]) == 0
    out, err = capsys.readouterr()
    assert TOKEN not in out + err
    written = [p for p in tmp_path.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert written == [] and all(r.authorised for r in hub.requests)


def test_a_repository_that_cannot_be_written_is_said_before_any_work(hub, tmp_path, monkeypatch, capsys):
    src = make_folder(tmp_path / "src", {"red": 4, "blue": 4})
    monkeypatch.setenv("HF_TOKEN", "hf_notTheRightOne")
    assert main(["shard", str(src), "hf://datasets/org/leafs"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "HF_TOKEN" in err and "hf_notTheRightOne" not in err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["shard", str(src), "hf://datasets/org/missing"]) == 2
    assert "hf repos create org/missing --repo-type dataset" in capsys.readouterr().err
    assert hub.repos["org/leafs"].commits == ["initial commit"]


@pytest.mark.parametrize("url, ok", [
    ("hf://datasets/org/leafs", True), ("hf://datasets/org/leafs@v2/sets/one", True),
    ("hf://datasets/org/leafs@refs/pr/3", True), ("hf://models/org/resnet", False),
    ("hf://datasets/org/leafs/../other", False), ("hf://datasets/org/leafs?token=x", False),
    ("hf://datasets/leafs", False)])
def test_hub_urls_name_a_data_set_repository_and_a_revision(url, ok):
    if ok:
        assert check_url(url) == url and redact(url) == url  # '@' is a revision here, not a password
    else:
        with pytest.raises(ConfigError, match="hf://datasets/ORG/NAME"):
            check_url(url)


def test_without_huggingface_hub_one_line_names_the_extra(hub, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert main(["inspect", "hf://datasets/org/leafs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'fastpipe[hf]'" in err


"""Data sets on the Hugging Face Hub (hf://datasets/ORG/NAME): written as one commit with a data card, read by every
command that reads a store, the token never written or printed. Against a loopback server that answers the Hub's
HTTP API as huggingface_hub calls it (fastpipe/testing/hubserver.py), selected with HF_ENDPOINT."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import epoch, make_folder, tree

pytest.importorskip("huggingface_hub")

from fastpipe import make_loader
from fastpipe.cli import main
from fastpipe.convert.driver import ShardConfig, shard
from fastpipe.dataset.loading import load
from fastpipe.errors import ConfigError
from fastpipe.store.urls import check_url, redact
from fastpipe.testing.hubserver import Hub, serve_hub
from fastpipe.testing.wds import timm_style_shards

TOKEN = "hf_fastpipeTestTokenDoNotPrint0123"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub on loopback that wants TOKEN for every request, with an empty data set repository org/leafs. (Other
    tests' readers run offline: huggingface_hub reads HF_HUB_OFFLINE once, at import.)"""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
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
    """A card goes only where the Hub reads one, the repository's root, and never over the owner's; a set in a
    folder of the repository is read at a revision."""
    src = make_folder(tmp_path / "src", {"red": 6, "blue": 6})
    hub.repos["org/leafs"].files["README.md"] = b"# our own card\n"
    shard(ShardConfig(src, "hf://datasets/org/leafs", **SETTINGS))
    assert hub.repos["org/leafs"].files["README.md"] == b"# our own card\n"
    shard(ShardConfig(src, "hf://datasets/org/leafs/sets/v1", **SETTINGS))
    assert "sets/v1/dataset.json" in hub.repos["org/leafs"].files
    assert "sets/v1/README.md" not in hub.repos["org/leafs"].files  # the Hub would not show it
    assert main(["inspect", "hf://datasets/org/leafs@main/sets/v1", "--verify"]) == 0


def test_the_token_never_reaches_a_file_or_a_message(hub, tmp_path, capsys):
    """Every command over hf:// with the token in HF_TOKEN: nothing under the working folders, the cache or the
    run holds it, nor anything printed, and every request for the data set carried it."""
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
    ours = [r for r in hub.requests if "/datasets/" in r.path]  # (huggingface_hub asks for a registry of its own)
    assert written == [] and ours and all(r.authorised for r in ours)  # the token was used, and went nowhere else


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
    ("hf://datasets/leafs", False), ("hf://datasets/org/..", False), ("hf://datasets/org/leafs@..", False),
    ("hf://datasets/-org/leafs", False), ("hf://datasets/org/le--afs", False),
    ("hf://user:hf_secret@datasets/org/leafs", False)])
def test_hub_urls_name_a_data_set_repository_and_a_revision(url, ok):
    if ok:
        assert check_url(url) == url and redact(url) == url  # '@' is a revision here, not a password
    else:
        with pytest.raises(ConfigError, match="hf://datasets/ORG/NAME") as e:
            check_url(url)
        assert "hf_secret" not in str(e.value)


@pytest.mark.parametrize("text", ["hf://user:hf_secret@datasets/org/set", "img_001https://u:hf_secret@h/x",
                                  "x=1s3://KEY:hf_secret@bucket/p", "s3://KEY:hf/secret@bucket/p"])
def test_credentials_in_any_url_are_redacted_hub_revisions_are_not(text):
    assert "hf_secret" not in redact(text) and "hf/secret" not in redact(text)
    assert redact("see hf://datasets/org/set@v2/a.tar") == "see hf://datasets/org/set@v2/a.tar"


def test_without_huggingface_hub_one_line_names_the_extra(hub, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert main(["inspect", "hf://datasets/org/leafs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'fastpipe[hf]'" in err



def test_shards_on_the_hub_are_indexed_where_they_are_from_their_headers(hub, tmp_path):
    """`fastpipe index hf://.../train-*.tar --out FOLDER`: timm-style shards in a repository the user cannot write
    are indexed by ranged reads of their tar headers (a small part of their bytes is fetched), the manifest kept in
    FOLDER, and the loaders read the shards from the Hub as the same shards indexed locally."""
    local = tmp_path / "local"
    train, val = timm_style_shards(local, 4, 40), timm_style_shards(local, 1, 12, "val")
    hub.create("timm/leafs-wds", {p.name: p.read_bytes() for p in train + val})
    base = "hf://datasets/timm/leafs-wds"
    before = len(hub.requests)
    assert main(["index", *[f"{base}/{p.name}" for p in train], "--val", f"{base}/{val[0].name}",
                 "--out", str(tmp_path / "idx"), "--stats-samples", "3"]) == 0
    total = sum(p.stat().st_size for p in train + val)
    reads = [r.sent for r in hub.requests[before:] if r.path.endswith(".tar")]
    images = 3 + 9 * 3  # drawn whole: for mean/std (--stats-samples) and the previews (9 a class); and a
    # request a sample (from its label on: the label, the metadata, the next header), one a shard for its first
    assert len(reads) <= 172 + 5 + images and sum(reads) < 0.4 * total, (len(reads), sum(reads), total)
    assert not any(r.method == "POST" for r in hub.requests[before:])  # nothing written to their repository
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == sorted(
        ["dataset.json", "previews", *[p.with_suffix(".idx").name for p in train + val]])
    assert main(["index", *map(str, train), "--val", str(val[0]), "--stats-samples", "3"]) == 0  # here, locally
    theirs = epoch(make_loader(tmp_path / "idx", batch_size=4, image_size=32, with_keys=True, num_workers=0))
    ours = epoch(make_loader(local, batch_size=4, image_size=32, with_keys=True, num_workers=0))
    assert theirs[1] == ours[1] and (theirs[2] == ours[2]).all()
    assert main(["inspect", str(tmp_path / "idx"), "--verify"]) == 0
    pinned = load(tmp_path / "idx").settings["shards_at"]  # their next push does not change what it describes
    assert pinned == f"{base}@{hub.repos['timm/leafs-wds'].sha}"


def test_shards_in_our_repository_are_indexed_beside_them_without_downloading_them(hub, tmp_path):
    """`fastpipe index hf://.../*.tar` (no --out): the .idx files, previews, reader files and dataset.json go beside
    the shards in one commit, from ranged reads of the tar headers; `--idx-only` rebuilds a lost index the same way.
    The set reads as the same shards indexed locally."""
    local = tmp_path / "local"
    train, val = timm_style_shards(local, 3, 30), timm_style_shards(local, 1, 10, "val")
    hub.create("org/wds", {p.name: p.read_bytes() for p in train + val})
    base, total = "hf://datasets/org/wds", sum(p.stat().st_size for p in train + val)
    before = len(hub.requests)
    assert main(["index", *[f"{base}/{p.name}" for p in train + val], "--stats-samples", "3"]) == 0  # val by name
    assert sum(r.sent for r in hub.requests[before:] if r.path.endswith(".tar")) < 0.4 * total
    assert len(hub.repos["org/wds"].commits) == 2  # the shards', then the index's
    assert {"dataset.json", "wids-train.json", "train-000000.idx", "val-000000.idx"} <= set(hub.repos["org/wds"].files)
    assert main(["index", *map(str, train), *map(str, val), "--stats-samples", "3"]) == 0  # here, locally
    theirs = epoch(make_loader(base, split="val", batch_size=4, image_size=32, with_keys=True, num_workers=0))
    ours = epoch(make_loader(local, split="val", batch_size=4, image_size=32, with_keys=True, num_workers=0))
    assert theirs[1] == ours[1] and (theirs[2] == ours[2]).all()
    assert hub.repos["org/wds"].files["train-000001.idx"] == (local / "train-000001.idx").read_bytes()
    before, commits = len(hub.requests), len(hub.repos["org/wds"].commits)
    assert main(["index", "--idx-only", *[f"{base}/{p.name}" for p in train[1:]]]) == 0
    assert sum(r.sent for r in hub.requests[before:] if r.path.endswith(".tar")) < 0.4 * sum(
        p.stat().st_size for p in train[1:])
    assert len(hub.repos["org/wds"].commits) == commits + 1  # the .idx files of both shards in one commit


def test_indexing_beside_shards_we_may_not_write_is_refused_before_the_walk(hub, tmp_path, capsys):
    train = timm_style_shards(tmp_path / "local", 2, 12)
    hub.create("timm/leafs-wds", {p.name: p.read_bytes() for p in train})
    hub.repos["timm/leafs-wds"].read_only = True
    before = len(hub.requests)
    assert main(["index", *[f"hf://datasets/timm/leafs-wds/{p.name}" for p in train]]) == 2
    err = capsys.readouterr().err
    assert "may not write" in err and len(err.strip().splitlines()) == 1
    assert not [r for r in hub.requests[before:] if r.path.endswith(".tar")]  # not one range of a shard read


def test_a_repair_of_an_index_kept_elsewhere_writes_the_index_not_their_shards(hub, tmp_path, capsys):
    """`inspect --verify --repair` of shards indexed where they are: the undecodable sample leaves the index kept
    here; their repository gets nothing."""
    import tarfile

    train = timm_style_shards(tmp_path / "local", 2, 12)
    with tarfile.open(train[1]) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(".jpg"))
    data = bytearray(train[1].read_bytes())
    data[member.offset_data : member.offset_data + 16] = bytes(16)  # no JPEG header: no decoder takes it
    train[1].write_bytes(bytes(data))
    hub.create("timm/leafs-wds", {p.name: p.read_bytes() for p in train})
    idx = tmp_path / "idx"
    assert main(["index", *[f"hf://datasets/timm/leafs-wds/{p.name}" for p in train], "--out", str(idx)]) == 0
    assert main(["inspect", str(idx), "--verify", "--repair", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "repaired: 1 samples" in capsys.readouterr().out
    assert hub.repos["timm/leafs-wds"].commits == ["initial commit"]
    assert load(idx).splits["train"].samples == 23
    loader = make_loader(idx, batch_size=4, image_size=32, num_workers=0, cache_dir=tmp_path / "c")
    list(loader)
    assert loader.stats.skipped == 0  # the sample is out of the index, not skipped


def test_an_index_of_their_shards_can_be_kept_in_a_repository_of_ours(hub, tmp_path):
    """--out another store's folder: the index files go there in one commit, their repository is untouched, and
    the set reads from there with the shards from theirs."""
    train = timm_style_shards(tmp_path / "local", 2, 12)
    hub.create("timm/leafs-wds", {p.name: p.read_bytes() for p in train})
    ours = "hf://datasets/org/leafs/timm-index"
    assert main(["index", *[f"hf://datasets/timm/leafs-wds/{p.name}" for p in train], "--out", ours]) == 0
    assert hub.repos["timm/leafs-wds"].commits == ["initial commit"] and len(hub.repos["org/leafs"].commits) == 2
    assert "timm-index/train-000000.idx" in hub.repos["org/leafs"].files
    _, labels, _ = epoch(make_loader(ours, batch_size=4, image_size=32, with_keys=True, num_workers=0))
    assert sorted(labels) == sorted(k % 3 for k in range(24))


def test_photos_on_the_hub_convert_as_the_same_photos_in_a_folder(hub, tmp_path):
    """`fastpipe shard hf://datasets/ORG/NAME/photos OUT`: the photos listed once and read from the Hub give the
    conversion of the same photos from a folder, byte for byte."""
    src = make_folder(tmp_path / "src", {"red": 6, "green": 5, "blue": 4}, size=(120, 90))
    hub.create("org/raw", {f"photos/{p.relative_to(src).as_posix()}": p.read_bytes() for p in src.rglob("*.jpg")})
    assert main(["shard", "hf://datasets/org/raw/photos", str(tmp_path / "from-hub"), "--short-side", "48",
                 "--workers", "1"]) == 0
    assert main(["shard", str(src), str(tmp_path / "from-folder"), "--short-side", "48", "--workers", "1"]) == 0
    assert tree(tmp_path / "from-hub") == tree(tmp_path / "from-folder")


def test_shards_the_hub_sends_to_its_cdn_are_read_there_without_the_token(tmp_path, monkeypatch):
    """The Hub answers a shard's resolve with a redirect to a signed URL elsewhere (its CDN): the loader asks the Hub
    once per shard, reads every range from the signed URL without sending the token there, and asks the Hub again
    when the URL has expired."""
    import huggingface_hub.constants

    from fastpipe.store.remote import Remote

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    state = Hub(token=TOKEN, cdn=True)
    src = make_folder(tmp_path / "src", {"red": 10, "green": 8, "blue": 6}, size=(120, 90))
    shard(ShardConfig(src, tmp_path / "local", **SETTINGS))
    state.create("org/leafs", tree(tmp_path / "local", skip=()))
    server, endpoint = serve_hub(state)
    for k, v in {"HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf-home"),
                 "FASTPIPE_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    try:
        ours = epoch(make_loader(tmp_path / "local", batch_size=4, image_size=32, with_keys=True, num_workers=0))
        theirs = epoch(make_loader("hf://datasets/org/leafs", batch_size=4, image_size=32, with_keys=True,
                                   num_workers=0))
        assert ours[1] == theirs[1] and (ours[2] == theirs[2]).all()
        resolved = [r.path for r in state.requests if "/resolve/" in r.path and r.path.endswith(".tar")]
        from_cdn = [r for r in state.requests if r.path.startswith("/cdn/")]
        assert len(resolved) == len(set(resolved)) < len(from_cdn)  # the Hub asked once a shard
        assert not any(r.authorised for r in from_cdn)  # and the token never went to the other host
        remote, name = Remote("hf://datasets/org/leafs"), sorted(resolved)[0].rsplit("/", 1)[1]
        first = remote.ranges([(name, 0, 512)])
        state.signature = "s2"  # every URL given so far expires
        before = len(state.requests)
        assert remote.ranges([(name, 0, 512)]) == first
        assert [r.path.split("/")[1] for r in state.requests[before:]] == ["cdn", "datasets", "cdn"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_whole_object_over_its_limit_is_refused_not_cut(hub):
    from fastpipe.store.remote import Remote, RemoteError

    hub.repos["org/leafs"].files["big.json"] = b"x" * 5000
    remote = Remote("hf://datasets/org/leafs")
    assert remote.cat("big.json", limit=5000) == b"x" * 5000
    with pytest.raises(RemoteError, match="over the limit of 4999"):
        remote.cat("big.json", limit=4999)


def test_an_upload_that_fails_keeps_the_conversion_and_says_so(hub, tmp_path, monkeypatch, capsys):
    """The Hub refusing the commit after the work: one line naming the staging folder that the same command
    uploads from again, and no commit."""
    src = make_folder(tmp_path / "src", {"red": 4, "blue": 4})
    real = hub.repos["org/leafs"]
    hub.refuse_commits = True
    assert main(["shard", str(src), "hf://datasets/org/leafs", "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run the same command again to upload them" in err, err
    assert real.commits == ["initial commit"]
    hub.refuse_commits = False
    assert main(["shard", str(src), "hf://datasets/org/leafs", "--workers", "1"]) == 0
    assert len(real.commits) == 2 and "dataset.json" in real.files


def test_doctor_says_where_the_hub_token_comes_from_never_what_it_is(hub, monkeypatch, capsys):
    from fastpipe.doctor import run_doctor

    run_doctor()
    out = capsys.readouterr().out
    assert "hf://" in out and "from HF_TOKEN" in out and TOKEN not in out
    assert f"{os.environ['HF_ENDPOINT']} answers" in out
    monkeypatch.delenv("HF_TOKEN")
    run_doctor()
    assert "none: public repositories only" in capsys.readouterr().out


def test_a_refused_read_says_what_the_hub_wants(hub, monkeypatch, capsys):
    """A private or gated repository read without a token that may: one line naming the token and the terms."""
    shard(ShardConfig(make_folder(Path(os.environ["HF_HOME"]) / "src", {"red": 4, "blue": 4}),
                      "hf://datasets/org/leafs", **SETTINGS))
    monkeypatch.setenv("HF_TOKEN", "hf_notTheRightOne")
    assert main(["inspect", "hf://datasets/org/leafs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HF_TOKEN" in err and "hf_notTheRightOne" not in err, err


def test_sharding_again_into_the_hub_is_checked_as_into_a_folder(hub, tmp_path, capsys):
    """A set already on the Hub: the same conversion is up to date; another one needs --overwrite, and then
    replaces it whole in one commit: the former shards it no longer has are deleted, and fastpipe's card rewritten."""
    src = make_folder(tmp_path / "src", {"red": 10, "green": 8, "blue": 6}, size=(120, 90))
    url = "hf://datasets/org/leafs"
    assert main(["shard", str(src), url, "--short-side", "48", "--workers", "1"]) == 0
    repo = hub.repos["org/leafs"]
    first = set(repo.files)
    assert main(["shard", str(src), url, "--short-side", "48", "--workers", "1"]) == 0  # up to date
    assert set(repo.files) == first
    capsys.readouterr()
    assert main(["shard", str(src), url, "--short-side", "40", "--min-shards", "1", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert url in err and "--short-side 40 (OUT has 48)" in err and "--overwrite" in err, err
    commits = len(repo.commits)
    assert main(["shard", str(src), url, "--short-side", "40", "--min-shards", "1", "--workers", "1",
                 "--overwrite"]) == 0
    assert len(repo.commits) == commits + 1
    shards = sorted(p for p in repo.files if p.endswith(".tar"))
    assert shards == ["train-000000.tar", "val-000000.tar"], shards  # none of the former set's left
    assert "short side of 40 px" in repo.files["README.md"].decode()


def test_offline_mode_is_said_at_once_not_retried(hub, monkeypatch, capsys):
    """HF_HUB_OFFLINE set (as some clusters do): one line, without the retries a passing fault gets; doctor warns."""
    import huggingface_hub.constants

    from fastpipe.doctor import run_doctor

    monkeypatch.setenv("FASTPIPE_REMOTE_ATTEMPTS", "6")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["inspect", "hf://datasets/org/leafs"]) == 2
    err = capsys.readouterr().err
    assert "offline" in err.lower() and "after 6 attempts" not in err, err
    run_doctor()
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().out

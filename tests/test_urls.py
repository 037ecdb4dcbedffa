"""What a data set from a store may make fastpipe do: its paths stay inside its folder on every protocol, URLs never
carry credentials into records or messages, and a hostile server cannot hold a read forever or fill memory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import COLORS, make_folder, photo

from fastpipe.dataset.loading import load
from fastpipe.dataset.manifest import ManifestError
from fastpipe.errors import ConfigError, DataError
from fastpipe.loaders import make_loader
from fastpipe.store.remote import RemoteError
from fastpipe.store.urls import check_relative, redact
from fastpipe.testing.devserver import Faults, FolderServer

pytestmark = pytest.mark.usefixtures("quick_retries")
KW = dict(batch_size=8, image_size=32, device="cpu", num_workers=0)


def _served_copy(converted, tmp_path, edit) -> tuple:
    """A copy of the data set with dataset.json edited, and beside it another prefix's data ('other/')."""
    root = tmp_path / "site"
    shutil.copytree(converted, root / "set")
    shutil.copytree(converted, root / "other")
    manifest = json.loads((root / "set" / "dataset.json").read_text())
    edit(manifest["splits"]["val"]["shards"][0])
    (root / "set" / "dataset.json").write_text(json.dumps(manifest))
    return root


@pytest.mark.parametrize("path", ["%2e%2e/other/val-000000.tar", "%2E%2E/other/val-000000.tar", "../other/val.tar",
                                  "./val-000000.tar", "sub//val.tar", "/other/val-000000.tar",
                                  "http://127.0.0.1:9/other/val-000000.tar", "..%2fother/val-000000.tar",
                                  "val-000000.tar?x=../../other", "%252e%252e/other/val.tar", "a\\..\\b.tar"])
def test_a_remote_manifest_cannot_point_outside_its_folder(converted, tmp_path, path):
    """An HTTP client decodes %2e%2e to .. and the server then serves /other/: the loader trained on another
    prefix's data. Every such path is refused naming the field and the data set's URL."""
    root = _served_copy(converted, tmp_path, lambda shard: shard.update(path=path))
    with FolderServer(root) as url, pytest.raises(ManifestError) as e:
        make_loader(f"{url}/set", split="val", cache_dir=tmp_path / "cache", **KW)
    assert f"{url}/set/dataset.json: splits.val.shards[0].path should be" in str(e.value)
    assert "cache" not in str(e.value)  # named by its URL, not by the local cache folder


def test_the_same_paths_are_refused_in_a_local_manifest(converted, tmp_path):
    shutil.copytree(converted, tmp_path / "set")
    manifest = json.loads((tmp_path / "set" / "dataset.json").read_text())
    manifest["splits"]["train"]["shards"][0]["index"] = "..%2f..%2fsecret.idx"
    (tmp_path / "set" / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"splits\.train\.shards\[0\]\.index should be plain names"):
        load(tmp_path / "set")


def test_a_bad_remote_manifest_is_named_by_its_url(converted, tmp_path):
    root = _served_copy(converted, tmp_path, lambda shard: shard.update(samples=-1))
    with FolderServer(root) as url, pytest.raises(ManifestError, match=rf"^{url}/set/dataset\.json: splits\.val"):
        load(f"{url}/set", cache_dir=tmp_path / "cache")


def test_every_path_fastpipe_writes_passes_the_policy(converted):
    m = load(converted)
    for sp in m.splits.values():
        for s in sp.shards:
            check_relative(s.path, "path") and check_relative(s.index, "index")


SECRET = "s3cr3t-Pa55"


URLS = [f"http://alice:{SECRET}@127.0.0.1:9/set", f"s3://AKIA:{SECRET}/x+y@bucket/set",
        f"http://127.0.0.1:9/set?X-Amz-Signature={SECRET}"]
COMMANDS = [["train", "{url}", "--epochs", "1"], ["bench", "{url}"], ["inspect", "{url}"], ["shard", "{src}", "{url}"],
            ["merge", "{url}"], ["index", "--idx-only", "{url}/train-000000.tar"], ["memory", "--data", "{url}"]]


@pytest.mark.parametrize("url,command", [(URLS[0], c) for c in COMMANDS] + [(u, COMMANDS[0]) for u in URLS[1:]])
def test_credentials_in_a_url_are_refused_and_never_written_or_printed(folder, tmp_path, url, command):
    out = tmp_path / "cwd"
    out.mkdir()
    args = [a.format(url=url, src=folder) for a in command]
    r = subprocess.run([sys.executable, "-m", "fastpipe", *args], capture_output=True, text=True, cwd=out,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert SECRET not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert "refused" in r.stderr and "***" in r.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert not any(SECRET in p.read_text(errors="replace") for p in written), written


def test_the_python_api_refuses_them_too(tmp_path):
    with pytest.raises(ConfigError) as e:
        make_loader(f"https://bob:{SECRET}@example.org/set", cache_dir=tmp_path)
    assert SECRET not in str(e.value) and "https://***@example.org/set" in str(e.value)


def test_redact_takes_every_credential_out_of_a_text():
    """The userinfo of a URL, and the value of every query or fragment parameter whatever its name; a URL read as a
    path (one slash left), and a URL quoted in a repr or in JSON, alike. Redacting twice changes nothing more."""
    text = (f"s3://KEY:{SECRET}@b/x failed; http://u:{SECRET}@h/p and az://acct/c?sig={SECRET}&se=2030 "
            f"then https://h/p?token={SECRET} or a.jpg?passwd={SECRET}&password={SECRET}#access_token={SECRET} "
            f"or https:/alice:{SECRET}@h/a.jpg or s3:/KEY:{SECRET}/x@y@bucket/a.jpg "
            f"in {['x.jpg?X-Amz-Signature=' + SECRET, 'cat']!r} and {json.dumps({'path': 'y?q=' + SECRET})}")
    out = redact(text)
    assert SECRET not in out and redact(out) == out
    assert "s3://***@b/x" in out and "se=***" in out and "https:/***@h/a.jpg" in out and "s3:/***@bucket/a.jpg" in out
    assert "['x.jpg?X-Amz-Signature=***', 'cat']" in out and '{"path": "y?q=***"}' in out
    plain = "a.jpg: no such file (no other URL, '..', %-escape, ? or #); what? column '#3': 'x'"
    assert redact(plain) == plain


def _hostile_list(tmp_path) -> Path:
    """A list that meets every rejection of a list's rows and of the photos it names, each row or name holding
    SECRET: as a URL's password, as the value of a query parameter of any name, in a file's own name."""
    data = tmp_path / "data"
    make_folder(data / "imgs", {"red": 3, "blue": 3}, size=(48, 36))
    imgs = data / "imgs"
    (imgs / f"ok.jpg?sig={SECRET}").write_bytes(photo(COLORS["red"], (48, 36), seed=50))  # a photo kept
    (imgs / f"dup.jpg?X-Amz-Signature={SECRET}").write_bytes((imgs / "red" / "img_000.jpg").read_bytes())
    (imgs / f"conflict.jpg?token={SECRET}").write_bytes((imgs / "blue" / "img_000.jpg").read_bytes())
    (imgs / f"broken.jpg?key={SECRET}").write_bytes(b"not a photo")
    (imgs / f"dir?sig={SECRET}").mkdir()
    os.symlink(f"loop?sig={SECRET}", imgs / f"loop?sig={SECRET}")
    good = [f"imgs/{c}/img_{i:03d}.jpg,{c}" for c in ("red", "blue") for i in range(3)]
    hostile = [f"http://bob:{SECRET}@host/a.jpg",  # one cell: bad-row
               f'http://carol:{SECRET}@host/b.jpg,"bad\x01label"', f"imgs/e.jpg,http://dave:{SECRET}@h/x",
               f"https://erin:{SECRET}@h/c.jpg,red,extra", f"s3://KEY:{SECRET}@b/d.jpg,red;blue",
               f"imgs/a.jpg?password={SECRET},red", f"imgs/b.jpg?passwd={SECRET},red",
               f"https://alice:{SECRET}@host/a.jpg,red", f"s3://KEY:{SECRET}/x@bucket/a.jpg,red",
               f"imgs/c.jpg?X-Amz-Signature={SECRET},red", f"/elsewhere/e.jpg?token={SECRET},red",
               f"imgs/dir?sig={SECRET},red", f"imgs/loop?sig={SECRET},red", f"imgs/ok.jpg?sig={SECRET},red",
               f"imgs/dup.jpg?X-Amz-Signature={SECRET},red", f"imgs/conflict.jpg?token={SECRET},red",
               f"imgs/broken.jpg?key={SECRET},red"]
    (data / "list.csv").write_text("\n".join(["path,label", *good, *hostile]) + "\n")
    return data / "list.csv"


def _no_secret_anywhere(out: Path, said: str) -> dict[str, str]:
    """Every file written (its bytes and its name) and all that was said: no SECRET; the rejections by path."""
    written = list(out.rglob("*"))
    assert written and not any(SECRET in p.name for p in written), [p.name for p in written]
    assert not [p for p in written if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert SECRET not in said and "Traceback" not in said, said[-3000:]
    return {r["path"]: r["reason"] for r in map(json.loads, (out / "rejected.jsonl").read_text().splitlines())}


def test_secrets_in_a_lists_rows_are_never_written_or_printed(tmp_path):
    """Every way a list's row (or the photo it names) is refused or kept, on disk and on an http(s) server: the
    rejections, dataset.json, the shards' per-sample records, the previews and their names, the journal, the summary
    and the command's output hold no password, token or signature of any row."""
    listed = _hostile_list(tmp_path)
    run = [sys.executable, "-m", "fastpipe", "shard", "--workers", "1", "--short-side", "32", "--val-fraction", "0"]
    r = subprocess.run([*run, str(listed), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    reasons = _no_secret_anywhere(tmp_path / "out", r.stdout + r.stderr)
    assert {"bad-row", "bad-label", "missing", "outside-root", "not-a-file", "unreadable", "duplicate",
            "label-conflict", "not-an-image"} <= set(reasons.values()), reasons
    assert reasons["imgs/a.jpg?password=***"] == "missing" and reasons["https:/***@host/a.jpg"] == "missing"
    assert load(tmp_path / "out").splits["train"].samples == 6  # 5 good rows (blue/img_000's twin is red) and ok.jpg
    remote = [f"{{url}}/imgs/red/img_000.jpg?password={SECRET},red", f"imgs/blue/img_000.jpg?passwd={SECRET},red"]
    with FolderServer(listed.parent) as url:
        (listed.parent / "remote.csv").write_text(listed.read_text() + "\n".join(remote).format(url=url) + "\n")
        r = subprocess.run([*run, f"{url}/remote.csv", str(tmp_path / "from-http")], capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    reasons = _no_secret_anywhere(tmp_path / "from-http", r.stdout + r.stderr)
    assert reasons[f"{url}/imgs/red/img_000.jpg?password=***"] == "outside-root", reasons


@pytest.fixture
def fast_deadline(monkeypatch):
    """Whole-object reads get 1 s plus their size limit at 1 GiB/s: about 1 s; one attempt."""
    monkeypatch.setenv("FASTPIPE_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("FASTPIPE_REMOTE_ATTEMPTS", "1")
    monkeypatch.setenv("FASTPIPE_REMOTE_MIN_RATE", str(1 << 30))


def test_a_server_that_trickles_fails_within_the_deadline(converted, tmp_path, fast_deadline):
    """A byte every 0.3 s resets the read timeout each time; the total deadline still ends the read."""
    faults = Faults(trickle=0.3, only="dataset.json")
    with FolderServer(converted, faults) as url:
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"dataset\.json .*no complete answer within 1 s"):
            load(url, cache_dir=tmp_path / "cache")
    assert time.monotonic() - start < 60  # the byte-by-byte answer would take minutes


def test_an_endless_answer_is_refused_before_it_is_read(converted, tmp_path, fast_deadline):
    """A dataset.json announced as a terabyte, with a body that never ends: read to 3.4 GB of memory before."""
    rss = psutil.Process().memory_info().rss
    with (FolderServer(converted, Faults(endless=True, only="dataset.json")) as url,
          pytest.raises(RemoteError, match="announces 1099511627776 bytes, over the limit of 67108864")):
        load(url, cache_dir=tmp_path / "cache")
    assert psutil.Process().memory_info().rss - rss < 200 << 20


def test_an_index_is_held_to_the_same_limit(converted, tmp_path, fast_deadline):
    with (FolderServer(converted, Faults(endless=True, only=".idx")) as url,
          pytest.raises(RemoteError, match=r"\.idx.*over the limit")):
        make_loader(url, cache_dir=tmp_path / "cache", **KW)


def test_a_download_that_trickles_fails_within_its_deadline(converted, tmp_path, fast_deadline):
    """Whole-file downloads (a conversion resumed from a store, shards adopted from a bucket) have a deadline too."""
    from fastpipe.store.remote import Remote

    shard = load(converted).split("val").shards[0].path
    with FolderServer(converted, Faults(trickle=0.3, only=".tar")) as url:
        start = time.monotonic()
        with pytest.raises(RemoteError, match=rf"{shard}"):
            Remote(url).get_many([(shard, tmp_path / "copy.tar")])
    assert time.monotonic() - start < 60


def _served_twice(converted, tmp_path) -> Path:
    """A site with the data set at /set and a copy at /moved/set."""
    root = tmp_path / "site"
    shutil.copytree(converted, root / "set")
    shutil.copytree(converted, root / "moved" / "set")
    return root


@pytest.mark.parametrize("what", ["dataset.json", ".idx", ".tar"])
def test_a_data_set_redirected_to_another_host_is_refused(converted, tmp_path, what):
    """A server that redirects the manifest, an index or a shard's ranges to another host: the loader read its
    samples from that host. Refused before the other host is asked anything, naming both URLs."""
    other = Faults()
    with (FolderServer(converted, other) as elsewhere,
          FolderServer(converted, Faults(redirect=elsewhere, only=what)) as url,
          pytest.raises(DataError) as e):  # a RemoteError; the loader's own DataError for a shard's ranges
        epoch_keys(make_loader(url, split="val", cache_dir=tmp_path / "cache", with_keys=True, **KW))
    assert re.search(rf"{url}/\S*{re.escape(what)} redirects to {elsewhere}/\S*{re.escape(what)}, another origin",
                     str(e.value)), str(e.value)
    assert other.answered == []


def test_a_redirect_within_the_origin_is_followed_and_bounded(converted, tmp_path):
    """Within one origin a redirect is followed (the same samples as from disk); an endless chain of them stops
    after MAX_REDIRECTS hops."""
    from fastpipe.store.clients import MAX_REDIRECTS

    root = _served_twice(converted, tmp_path)
    local = epoch_keys(make_loader(converted, split="val", with_keys=True, **KW))
    with FolderServer(root, Faults(redirect="/moved", only=" /set/")) as url:
        assert epoch_keys(make_loader(f"{url}/set", split="val", cache_dir=tmp_path / "a", with_keys=True,
                                      **KW)) == local
    chain = Faults(redirect="/set", only="/dataset.json")  # /set/dataset.json -> /set/set/dataset.json -> ...
    with FolderServer(root, chain) as url, pytest.raises(RemoteError, match="TooManyRedirects"):
        load(f"{url}/set", cache_dir=tmp_path / "b")
    assert len(chain.answered) == MAX_REDIRECTS + 1  # the first answer and each hop followed, once: not retried


def epoch_keys(loader) -> list[str]:
    return [f"{s.shard}/{s.key}" for _, _, keys in loader for s in keys]


def _list_with_a_redirected_row(tmp_path) -> Path:
    """red and green photos, cat/redir.jpg (redirected by the tests' server) and big/big.jpg (over 20 KB), listed."""
    src = make_folder(tmp_path / "photos", {"red": 3, "green": 3})
    (src / "cat").mkdir()
    (src / "cat" / "redir.jpg").write_bytes(photo(COLORS["blue"], seed=9))
    (src / "big").mkdir()
    (src / "big" / "big.jpg").write_bytes(photo(COLORS["blue"], size=(400, 300), seed=10))
    rows = [f"{p.relative_to(src).as_posix()},{p.parent.name}" for p in sorted(src.rglob("*.jpg"))]
    (src / "photos.csv").write_text("\n".join(rows) + "\n")
    return src


def test_a_list_redirected_to_another_host_is_refused(tmp_path):
    """An http(s) list answered with a redirect to another host: the other host would serve every row. The
    conversion stops naming both URLs; nothing of the other host's is asked for or written."""
    from fastpipe.convert.driver import ShardConfig, shard

    src = _list_with_a_redirected_row(tmp_path)
    other = Faults()
    with (FolderServer(src, other) as elsewhere,
          FolderServer(src, Faults(redirect=elsewhere, only="photos.csv")) as url, pytest.raises(RemoteError) as e):
        shard(ShardConfig(f"{url}/photos.csv", tmp_path / "out", short_side=32, val_fraction=0, workers=1))
    assert re.search(rf"{url}/photos.csv redirects to {elsewhere}/photos.csv, another origin", str(e.value)), \
        str(e.value)
    assert other.answered == []
    assert not list((tmp_path / "out").glob("*.tar"))


def test_a_photo_redirected_to_another_host_is_its_rows_rejection_only(tmp_path, capsys):
    """One row of an http(s) list answered with a redirect to another host stopped the whole conversion, the other
    rows with it (a too-large one included). Now that row alone is rejected (outside-root), its detail naming both
    URLs with the credentials of the redirect's target taken out; the other host is asked nothing, and every other
    row converts or is rejected as it would be."""
    from fastpipe.cli import main

    src = _list_with_a_redirected_row(tmp_path)
    other = Faults()
    with FolderServer(src, other) as elsewhere:
        moved = elsewhere.replace("http://", f"http://user:{SECRET}@")
        with FolderServer(src, Faults(redirect=moved, only="redir.jpg")) as url:
            code = main(["shard", f"{url}/photos.csv", str(tmp_path / "out"), "--workers", "1", "--short-side", "32",
                         "--val-fraction", "0", "--max-file-size", "20KB"])
    said = capsys.readouterr()
    assert code == 0, said.err[-3000:]
    rows = {r["path"]: r for r in map(json.loads, (tmp_path / "out" / "rejected.jsonl").read_text().splitlines())}
    assert {p: r["reason"] for p, r in rows.items()} == {"cat/redir.jpg": "outside-root", "big/big.jpg": "too-large"}
    # the URL asked is named as every detail names its photo, by the row's path in the list's folder
    assert rows["cat/redir.jpg"]["detail"].startswith(f"cat/redir.jpg redirects to http://***@{elsewhere[7:]}"
                                                      f"/cat/redir.jpg, another origin (scheme, host, port)")
    assert other.answered == []
    assert load(tmp_path / "out").splits["train"].samples == 6
    assert SECRET not in (tmp_path / "out" / "rejected.jsonl").read_text() + said.out + said.err


def test_a_list_over_the_row_limit_is_refused_before_a_photo_is_asked_for(tmp_path, capsys):
    """A list of 3 million rows in a store made 3 million requests and held 1.7 GB. A list of more rows than
    --max-rows (a million unless raised) is refused once fetched, before a row is read: one request, and memory
    for its bytes only; on disk it is counted a MiB at a time. The message says how to convert it anyway."""
    from fastpipe.cli import main
    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.convert.sources import MAX_ROWS

    (tmp_path / "photos.csv").write_bytes(b"".join(b"p%07d.jpg,cat\n" % i for i in range(MAX_ROWS + 1)))
    faults = Faults()
    rss = psutil.Process().memory_info().rss
    with FolderServer(tmp_path, faults) as url, pytest.raises(DataError) as e:
        shard(ShardConfig(f"{url}/photos.csv", tmp_path / "out", workers=1))
    assert psutil.Process().memory_info().rss - rss < 200 << 20  # the parsed rows held 1.7 GB
    assert str(e.value) == (f"{url}/photos.csv: more than {MAX_ROWS:,} rows, the limit for a list (each is a photo "
                            f"to read; from a store, a request): raise --max-rows to convert a longer list")
    assert faults.answered == ["GET /photos.csv HTTP/1.1"]
    (tmp_path / "few.csv").write_text("a.jpg,cat\nb.jpg,cat\nc.jpg,dog\n")
    assert main(["shard", str(tmp_path / "few.csv"), str(tmp_path / "out"), "--max-rows", "2"]) == 2
    assert "few.csv: more than 2 rows, the limit for a list" in capsys.readouterr().err

"""The node cache on a machine shared with other users: each user's cache is a folder of their own, and no file in
it is written or read through a link fastpipe did not make, or when another user owns it."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import epoch

from fastpipe.dataset.loading import load
from fastpipe.loaders import make_loader
from fastpipe.store.cachefiles import CacheNotPrivate, private_folder
from fastpipe.testing.devserver import FolderServer

KW = dict(batch_size=8, image_size=32, device="cpu", num_workers=0, with_keys=True)
OTHER_UID = 4242  # another user of the machine
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")


def _shared_root(tmp_path):
    root = tmp_path / "scratch"
    root.mkdir()
    root.chmod(0o1777)  # what a shared scratch folder is: everyone may create there
    return root


def test_a_shared_root_gives_each_user_a_private_folder(converted, tmp_path):
    root = _shared_root(tmp_path)
    with FolderServer(converted) as url:
        loader = make_loader(url, split="val", cache_dir=root, **KW)
        epoch(loader)
    (own,) = root.iterdir()
    assert own.name.endswith(f"-{os.geteuid()}") and stat.S_IMODE(own.stat().st_mode) == 0o700
    assert list(own.glob("*.shard")) and not list(root.glob("*.shard"))


def test_a_link_planted_under_a_users_folder_name_is_refused(tmp_path):
    root = _shared_root(tmp_path)
    victim_target = tmp_path / "attacker"
    victim_target.mkdir()
    name = private_folder(root).name  # what the user's folder is called
    (root / name).rmdir()
    (root / name).symlink_to(victim_target)  # planted before the user's first run
    with pytest.raises(CacheNotPrivate, match=rf"{name} is not private to this user"):
        private_folder(root)


@as_root
def test_a_folder_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(CacheNotPrivate, match=f"owner uid {OTHER_UID}"):
        private_folder(theirs)


def _plant(converted, tmp_path, make) -> tuple:
    """A cache folder where a file named as a shard's cache file (its sha256, public in dataset.json) was put by
    someone else; `make(path)` puts it there."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    sha = load(converted).split("val").shards[0].sha256
    make(cache / f"{sha}.shard")
    return cache, sha


def test_a_link_under_a_shards_cache_name_is_never_written_through(converted, tmp_path):
    """The link points to a file of exactly the cache file's size (shard bytes + a byte per sample, both public in
    dataset.json): the loader wrote the shard's bytes into it."""
    shard = load(converted).split("val").shards[0]
    precious = tmp_path / "precious.txt"
    content = (b"a user's file\n" * shard.bytes)[: shard.bytes + shard.samples]
    precious.write_bytes(content)
    cache, _ = _plant(converted, tmp_path, lambda p: p.symlink_to(precious))
    with FolderServer(converted) as url, pytest.raises(CacheNotPrivate, match="is a link, which fastpipe did not make"):
        epoch(make_loader(url, split="val", cache_dir=cache, **KW))
    assert precious.read_bytes() == content


@as_root
def test_a_cache_file_another_user_owns_is_not_used(converted, tmp_path):
    def theirs(path):
        path.write_bytes(b"\0" * 1024)
        os.chown(path, OTHER_UID, OTHER_UID)

    cache, _ = _plant(converted, tmp_path, theirs)
    with FolderServer(converted) as url, pytest.raises(CacheNotPrivate, match=f"owner uid {OTHER_UID}"):
        epoch(make_loader(url, split="val", cache_dir=cache, **KW))


def test_a_link_under_an_index_copy_name_is_not_read(converted, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("v1.2 1\njpg 1 1 x\n")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    sha = load(converted).split("val").shards[0].sha256
    (cache / f"{sha}.idx").symlink_to(secret)
    with FolderServer(converted) as url, pytest.raises(CacheNotPrivate, match=r"\.idx is a link"):
        make_loader(url, split="val", cache_dir=cache, **KW)

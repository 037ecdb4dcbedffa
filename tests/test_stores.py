"""gs:// and az:// against real servers on loopback: gcp-storage-emulator (a GCS JSON-API server, from PyPI) and
Azurite (Microsoft's Azure Storage server, from npm; scripts/setup.sh installs it in .tools/), each behind the
fault proxy of tests/test_remote.py (503s, reset connections, stalls past the timeout). What a user of either store
checks: every sample read by URL with its label, nothing lost or repeated, each fault retried by fastpipe's own
policy (counted in loader.stats, not hidden in the client's), `fastpipe shard SRC gs://|az://` giving the local
bytes, and refused credentials named at once."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import epoch

from fastpipe.loaders import make_loader
from fastpipe.store.remote import Remote, RemoteError
from fastpipe.testing.devserver import Faults, FolderServer

KW = dict(batch_size=8, image_size=32, device="cpu", with_keys=True)
AZURITE = Path(__file__).resolve().parent.parent / ".tools/azurite/node_modules/.bin/azurite-blob"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # public


pytestmark = pytest.mark.usefixtures("quick_retries")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server on port {port} did not start: {proc.stdout.read() if proc.stdout else ''}")


def azure_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={key};"
            f"BlobEndpoint={endpoint}/devstoreaccount1;")


@pytest.fixture(scope="session")
def gcs(converted):
    """gcp-storage-emulator in this process (a thread), the converted set uploaded to gs://leafs/sets/v1."""
    pytest.importorskip("gcsfs")  # imported before fastpipe sees STORAGE_EMULATOR_HOST, as in a user's program
    server_mod = pytest.importorskip("gcp_storage_emulator.server")
    port = free_port()
    server = server_mod.create_server("127.0.0.1", port, in_memory=True, default_bucket="leafs")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", endpoint)  # Google's variable: gcsfs, and fastpipe's CLI, read it
        Remote("gs://leafs/sets/v1").put_many(
            [(p, p.relative_to(converted).as_posix()) for p in sorted(converted.rglob("*")) if p.is_file()])
        yield endpoint
    server.stop()


@pytest.fixture(scope="session")
def azure(converted):
    """Azurite in its own process (in memory), the converted set uploaded to az://leafs/sets/v1."""
    pytest.importorskip("adlfs")
    binary = AZURITE if AZURITE.exists() else shutil.which("azurite-blob")
    if not binary:
        pytest.skip("Azurite is not installed (scripts/setup.sh installs it with npm)")
    port = free_port()
    proc = subprocess.Popen([str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                             "--skipApiVersionCheck", "--loose", "--silent"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_port(port, proc)
        endpoint = f"http://127.0.0.1:{port}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_string(endpoint))  # adlfs reads it
            remote = Remote("az://leafs/sets/v1")
            remote._client()[0].mkdir("leafs")
            remote.put_many([(p, p.relative_to(converted).as_posix())
                             for p in sorted(converted.rglob("*")) if p.is_file()])
            yield endpoint
    finally:
        proc.kill()
        proc.wait()


def through(store: str, proxy: str) -> dict:
    """storage_options that send a store's client to the fault proxy in front of its server."""
    if store == "gs":
        return {"endpoint_url": proxy, "token": "anon"}
    return {"connection_string": azure_string(proxy)}


@pytest.mark.slow  # the same faults against S3 (test_remote.py) run by default
@pytest.mark.parametrize("store", ["gs", "az"])
def test_every_sample_by_url_under_faults(store, converted, tmp_path, request):
    endpoint = request.getfixturevalue({"gs": "gcs", "az": "azure"}[store])
    local = epoch(make_loader(converted, split="train", num_workers=2, **KW))
    faults = Faults(error_every=4, reset_every=5, stall_every=7, stall=3.0, only=".tar")
    start = time.monotonic()
    with FolderServer(None, faults, proxy_to=endpoint) as proxy:
        loader = make_loader(f"{store}://leafs/sets/v1", split="train", num_workers=2, cache_dir=tmp_path / "c",
                             storage_options=through(store, proxy), **KW)
        remote = epoch(loader)
    assert faults.errors and faults.resets and faults.stalls  # the faults were met ...
    assert remote[:2] == local[:2] and torch.equal(remote[2], local[2])  # ... and the epoch is the local one
    # fastpipe's policy retried the 503s, not the client's (the Azure SDK would first sleep 15 s, gcsfs 1-2 s,
    # silently; aiohttp itself may retry a reset connection it had kept alive, so resets are not counted on)
    assert loader.stats.retries >= faults.errors
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("store", ["gs", "az"])
def test_shard_into_the_store_gives_the_local_bytes(store, folder, tmp_path, monkeypatch, request):
    """`fastpipe shard SRC gs://... | az://...` with the endpoint and credentials from the store's environment."""
    from fastpipe.cli import main
    from fastpipe.convert.driver import ShardConfig, shard

    request.getfixturevalue({"gs": "gcs", "az": "azure"}[store])  # sets the environment variable for the session
    monkeypatch.setenv("FASTPIPE_CACHE", str(tmp_path / "cache" / "shards"))
    shard(ShardConfig(folder, tmp_path / "local", short_side=48, val_fraction=0.25, max_shard_size=64 * 1024,
                      workers=1))
    url = f"{store}://leafs/written/{store}"
    assert main(["shard", str(folder), url, "--short-side", "48", "--val-fraction", "0.25", "--max-shard-size",
                 "64KB", "--workers", "1"]) == 0
    local = sorted(p.relative_to(tmp_path / "local").as_posix() for p in (tmp_path / "local").rglob("*")
                   if p.is_file() and not p.name.startswith("."))
    remote = Remote(url)
    assert [remote.cat(rel) for rel in local] == [(tmp_path / "local" / rel).read_bytes() for rel in local]
    keys, labels, _ = epoch(make_loader(url, split="val", num_workers=0, cache_dir=tmp_path / "c", **KW))
    assert (keys, labels) == epoch(make_loader(tmp_path / "local", split="val", num_workers=0, **KW))[:2]


@pytest.mark.dali
def test_workers_forked_from_a_server_process_use_the_environment_of_now(azure, converted, tmp_path, monkeypatch):
    """Once DALI is loaded, loader workers fork from a server process that holds the environment of when it
    started. A variable set since (here the store's endpoint: the fault proxy in front of Azurite) must still
    reach the workers, or they read from elsewhere than the trainer asked."""
    import multiprocessing.forkserver

    import nvidia.dali  # noqa: F401  (the loaders' workers now fork from the server: loaders/stream.py)

    multiprocessing.forkserver.ensure_running()  # started before the variable is set
    faults = Faults(only=".tar")
    with FolderServer(None, faults, proxy_to=azure) as proxy:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_string(proxy))
        loader = make_loader("az://leafs/sets/v1", split="train", num_workers=2, cache_dir=tmp_path / "c", **KW)
        remote = epoch(loader)
    assert faults.count >= 2  # the workers' shard ranges went through the proxy
    assert remote[:2] == epoch(make_loader(converted, split="train", num_workers=0, **KW))[:2]


@pytest.mark.parametrize("store", ["gs", "az"])
def test_parts_into_the_store_then_merge_there(store, folder, tmp_path, monkeypatch, capsys, request):
    """A cluster conversion into GCS or Azure: `shard SRC URL --parts 2 --part i`, then `merge URL` (it lists the
    part manifests: a store that lists objects); the merged set reads back as the same parts merged locally."""
    from fastpipe.cli import main
    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.convert.merge import merge_parts
    from fastpipe.dataset.loading import load

    request.getfixturevalue({"gs": "gcs", "az": "azure"}[store])
    monkeypatch.setenv("FASTPIPE_CACHE", str(tmp_path / "cache" / "shards"))
    url, settings = f"{store}://leafs/cluster/{store}", dict(short_side=48, val_fraction=0.25, max_shard_size=64 * 1024)
    for i in range(2):
        shard(ShardConfig(folder, tmp_path / "local", parts=2, part=i, workers=1, **settings))
        assert main(["shard", str(folder), url, "--parts", "2", "--part", str(i), "--short-side", "48",
                     "--val-fraction", "0.25", "--max-shard-size", "64KB", "--workers", "1"]) == 0
    merge_parts(tmp_path / "local")
    assert main(["merge", url]) == 0, capsys.readouterr().err
    merged, local = load(url), load(tmp_path / "local")
    assert merged.splits == local.splits and sorted(merged.outputs["previews"]) == sorted(local.classes)
    for split in ("train", "val"):
        keys, labels, _ = epoch(make_loader(url, split=split, num_workers=0, cache_dir=tmp_path / "c", **KW))
        assert (keys, labels) == epoch(make_loader(tmp_path / "local", split=split, num_workers=0, **KW))[:2]


@pytest.mark.parametrize("store", ["gs", "az"])
def test_index_and_verify_shards_another_tool_wrote_into_the_store(store, tmp_path, monkeypatch, capsys, request):
    """`fastpipe index URL.tar ... --val ...` adopts webdataset shards in GCS or Azure (their .idx files and
    dataset.json written beside them), which read back as the same shards indexed locally and verify intact."""
    from conftest import webdataset_shards

    from fastpipe.cli import main
    from fastpipe.convert.foreign import IndexConfig, index_shards

    request.getfixturevalue({"gs": "gcs", "az": "azure"}[store])
    monkeypatch.setenv("FASTPIPE_CACHE", str(tmp_path / "cache" / "shards"))
    local = tmp_path / "local"
    tars = webdataset_shards(local, count=15, per_shard=10)
    prefix = f"{store}://leafs/foreign-{store}"
    Remote(prefix).put_many([(t, t.name) for t in tars])
    assert main(["index", f"{prefix}/{tars[0].name}", "--val", f"{prefix}/{tars[1].name}"]) == 0
    index_shards(IndexConfig(tars[:1], val=tars[1:]))  # the same shards, indexed on the local disk
    for split in ("train", "val"):
        remote = epoch(make_loader(prefix, split=split, num_workers=0, cache_dir=tmp_path / "c", **KW))
        assert remote[:2] == epoch(make_loader(local, split=split, num_workers=0, **KW))[:2]
    capsys.readouterr()
    assert main(["inspect", prefix, "--verify", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "verified 15 samples in 2 shards: all intact" in capsys.readouterr().out


def test_refused_azure_credentials_are_named_at_once(azure, tmp_path, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_string(azure, key="V3JvbmcgS2V5" * 6))
    start = time.monotonic()
    with pytest.raises(RemoteError, match=r"az://leafs/sets/v1/dataset.json: access refused.*credentials"):
        make_loader("az://leafs/sets/v1", cache_dir=tmp_path / "c")
    assert time.monotonic() - start < 10  # not retried: another try will not change the store's mind


def test_a_missing_gcs_object_is_named(gcs, tmp_path):
    with pytest.raises(RemoteError, match=r"gs://leafs/nothing-here/dataset.json not found"):
        make_loader("gs://leafs/nothing-here", cache_dir=tmp_path / "c")



def test_doctor_probes_each_store_endpoint_and_never_prints_a_key(gcs, azure, monkeypatch, capsys):
    from fastpipe.doctor import run_doctor

    run_doctor()
    out = capsys.readouterr().out
    assert "reads s3://, gs://, az://, http://" in out
    lines = {line[7:].split()[0]: line for line in out.splitlines() if line.startswith("[")}  # "[OK  ] name ..."
    assert f"{gcs} answers" in lines["STORAGE_EMULATOR_HOST"]
    assert f"{azure}/devstoreaccount1 answers" in lines["AZURE_STORAGE_CONNECTION_STRING"]
    assert AZURITE_KEY not in out
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")  # nothing listens on the discard port
    run_doctor()
    assert "http://127.0.0.1:9 does not answer" in capsys.readouterr().out

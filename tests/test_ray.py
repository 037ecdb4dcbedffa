"""`fastpipe shard --ray`: the photo work as tasks on a real Ray cluster on loopback (a head and one more node, one CPU
each, started for these tests and stopped at the end), with SRC and OUT on disk and in moto's S3 server. Wherever a
photo was converted, the output is the bytes of a one-machine run: with a worker killed mid-way too (Ray runs its task
again; no photo is written twice). A photo that crashes its worker each time stops the run naming it, and the rerun
resumes; Ctrl-C cancels the tasks in flight. Skipped where Ray is not installed (pip install 'fastpipe[ray]'); the
conversions that kill and restart Ray's worker processes run with -m slow (one task's worker killed once, to see the
task report its second try, runs by default)."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
from conftest import manifest_without_source, messy_photos, tree
from test_nearcopy import COPIES, natural, write

ray = pytest.importorskip("ray")

from fastpipe.convert import photos  # noqa: E402
from fastpipe.convert.driver import ShardConfig, shard  # noqa: E402
from fastpipe.store.remote import Remote  # noqa: E402

TIMEOUT = 600  # seconds a test may take: a cluster that hangs fails its test instead of holding the machine
BUCKET_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(autouse=True)
def bounded():
    def hung(*_):
        raise TimeoutError(f"a Ray test ran over {TIMEOUT} s")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(TIMEOUT)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


@pytest.fixture(scope="module")
def cluster(s3_bucket):
    """A head node and one more, 1 CPU each. Like the nodes of any cluster, they read the bucket with credentials of
    their own: the AWS variables of the environment they start in (fastpipe does not send this machine's)."""
    from ray.cluster_utils import Cluster

    env = {"AWS_ENDPOINT_URL": s3_bucket[0], **BUCKET_ENV}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-ins below run on the nodes
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        nodes.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def data(cluster, tmp_path_factory):
    """60 small photos and one file for each rejection rule, on disk and in the bucket, and their conversion on one
    machine in one process: the reference every Ray run must equal."""
    base = tmp_path_factory.mktemp("ray")
    src = base / "photos"
    limits = messy_photos(src, {"red": 24, "green": 20, "blue": 16})
    for k in range(3):  # pictures with a near-copy each: the groups, and the split they move, must be the same too
        write(src / "red" / f"scene{k}.jpg", natural(k, (80, 60)))
        write(src / "red" / f"scene{k}-darker.jpg", COPIES["darker"](natural(k, (80, 60))))
    Remote("s3://leafs/ray/photos").put_many([(p, p.relative_to(src).as_posix()) for p in src.rglob("*")
                                               if p.is_file()])
    kw = dict(short_side=32, val_fraction=0.25, max_shard_size=64 * 1024, **limits)
    shard(ShardConfig(src, base / "reference", workers=1, **kw))
    assert len((base / "reference" / "near-duplicates.jsonl").read_text().splitlines()) == 3
    return src, kw, base / "reference"


def same_as_reference(out: Path, reference: Path) -> None:
    assert tree(out) == tree(reference)  # shards, indexes, previews, rejected.jsonl
    assert manifest_without_source(out / "dataset.json") == manifest_without_source(reference / "dataset.json")


def ray_note(summary) -> str:
    return next(n for n in summary.notes if n.startswith("converted on Ray"))


def test_a_conversion_on_ray_is_the_bytes_of_one_machine(cluster, data, tmp_path, monkeypatch):
    """SRC and OUT on disk (the nodes share it, as a cluster's shared file system): every node converts."""
    src, kw, reference = data
    summary = shard(ShardConfig(src, tmp_path / "out", ray_address=cluster.address, **kw))
    same_as_reference(tmp_path / "out", reference)
    # the tasks are SPREAD, a preference to Ray: a node slow to start its worker on a busy machine may get none
    assert re.search(r"\d+ tasks on [12] of 2 nodes", ray_note(summary)), summary.notes


def test_from_a_bucket_into_a_bucket_on_ray(cluster, data, tmp_path, monkeypatch, capsys):
    """`fastpipe shard s3://... s3://... --ray-address ...`: the bucket is listed here, each node reads the photos it
    converts from the store itself, and the set written into the bucket is the same bytes."""
    from fastpipe.cli import main

    _, kw, reference = data
    monkeypatch.setenv("FASTPIPE_CACHE", str(tmp_path / "cache" / "shards"))
    flags = ["--short-side", "32", "--val-fraction", "0.25", "--max-shard-size", "64KB", "--max-pixels",
             str(kw["max_pixels"]), "--max-file-size", f"{kw['max_file_size']}B"]
    url = "s3://leafs/ray/sets/v1"
    assert main(["shard", "s3://leafs/ray/photos", url, "--ray-address", cluster.address, *flags]) == 0
    assert re.search(r"converted on Ray \(cluster at .*\): \d+ tasks on [12] of 2 nodes", capsys.readouterr().out)
    store = Remote(url)
    store.get_many([(rel, _local(tmp_path / "out" / rel)) for rel, _ in store.listing()])
    same_as_reference(tmp_path / "out", reference)


def _local(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _kills_its_worker_once(where: str, marker: str, flag: str):
    """The per-photo step, its worker process killed (as by the system) the first time it meets `marker`."""
    from fastpipe.convert import photos

    if where.endswith(marker) and not os.path.exists(flag):
        Path(flag).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return photos.convert_one(where)


def _dies_on_its_first_try(flag: str) -> int:
    from fastpipe.convert.onray import _attempt

    if not os.path.exists(flag):
        Path(flag).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return _attempt()


def test_a_task_run_again_says_so(cluster, tmp_path):
    """Retries are counted from the try each task reports (the progress record of a lost try is not waited for, so
    it may never arrive): a task whose first worker process died reports its second try, and the board counts each
    task's tries once whatever the order its records arrive in."""
    from fastpipe.convert.raycluster import Board, driver

    ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        task = ray.remote(max_retries=1)(_dies_on_its_first_try)
        assert ray.get(task.remote(str(tmp_path / "died")), timeout=TIMEOUT / 2) == 1
        board = Board.remote(driver())  # the records of two tries of task 1 arrive in the wrong order
        board.started.remote(1, "node-b", 1)
        board.finished.remote(1)
        board.started.remote(1, "node-a", 0)  # the late record of the lost try: no retry more, and node-a not busy
        for _ in range(2):  # where Ray does not say which try: the starts recorded are counted
            board.started.remote(2, "node-c", None)
        board.finished.remote(2)
        assert ray.get(board.snapshot.remote(), timeout=TIMEOUT / 2) == (2, 0)
        assert ray.get(board.runs_again.remote(), timeout=TIMEOUT / 2) == {1: 1, 2: 1}
    finally:
        ray.shutdown()


@pytest.mark.slow  # worker processes killed and started again: minutes on a busy 2-core machine
def test_a_worker_killed_mid_way_is_run_again_and_the_bytes_are_the_same(cluster, data, tmp_path, monkeypatch):
    src, kw, reference = data
    flag = tmp_path / "killed"
    monkeypatch.setattr(photos, "convert_one", partial(_kills_its_worker_once, marker="red/img_005.jpg",
                                                       flag=str(flag)))
    summary = shard(ShardConfig(src, tmp_path / "out", ray_address=cluster.address, **kw))
    assert flag.exists()  # the worker was killed ...
    again = re.search(r"(\d+) tasks run again", ray_note(summary))
    assert again and int(again.group(1)) >= 1, summary.notes  # ... its task run again ...
    same_as_reference(tmp_path / "out", reference)  # ... and every photo written once, in its place


def _crashes_on(where: str, marker: str, how: str):
    """A decoder that crashes its process (or raises) on one photo, whatever the try."""
    from fastpipe.convert import photos

    if where.endswith(marker):
        if how == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("the decoder lost its way")
    return photos.convert_one(where)


def last_train_photo(reference: Path) -> str:
    """The path of the last sample of the train split: a crash there comes after the first shards are done."""
    import json
    import tarfile

    last = sorted(reference.glob("train-*.tar"))[-1]
    with tarfile.open(last) as tf:
        metas = [json.loads(tf.extractfile(m).read()) for m in tf.getmembers() if m.name.endswith(".json")]
    return metas[-1]["path"]


@pytest.mark.slow  # worker processes killed and started again: minutes on a busy 2-core machine
def test_a_photo_that_fails_each_time_stops_the_run_naming_it_and_the_rerun_resumes(cluster, data, tmp_path,
                                                                                   monkeypatch):
    from fastpipe.errors import DataError

    src, kw, reference = data
    marker = last_train_photo(reference)
    cfg = ShardConfig(src, tmp_path / "out", ray_address=cluster.address, **kw)
    monkeypatch.setattr(photos, "convert_one", partial(_crashes_on, marker=marker, how="raise"))
    with pytest.raises(DataError, match=rf"{re.escape(marker)}: converting it raised ValueError: the decoder lost"):
        shard(cfg)
    monkeypatch.setattr(photos, "convert_one", partial(_crashes_on, marker=marker, how="crash"))
    with pytest.raises(DataError, match=rf"{re.escape(marker)}: the worker process converting it died each time"):
        shard(cfg)
    assert not (tmp_path / "out" / "dataset.json").exists() and list((tmp_path / "out").glob("train-*.tar"))
    monkeypatch.undo()
    rerun = shard(cfg)
    assert 0 < rerun.converted_now < sum(rerun.written.values())  # resumed after the shards finished before
    same_as_reference(tmp_path / "out", reference)


def _blocks(where: str, started: str):
    """A photo that takes longer than any test: its task holds its CPU until it is cancelled."""
    Path(started, str(os.getpid())).touch()
    time.sleep(600)


@pytest.mark.slow  # worker processes killed and started again: minutes on a busy 2-core machine
def test_ctrl_c_cancels_the_tasks_in_flight(cluster, data, tmp_path, monkeypatch):
    src, kw, _ = data
    started = tmp_path / "started"
    started.mkdir()
    monkeypatch.setattr(photos, "convert_one", partial(_blocks, started=str(started)))

    def interrupt_once_both_cpus_are_busy():
        deadline = time.monotonic() + TIMEOUT
        while len(list(started.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # as Ctrl-C reaches the main thread

    threading.Thread(target=interrupt_once_both_cpus_are_busy, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        shard(ShardConfig(src, tmp_path / "out", ray_address=cluster.address, **kw))
    assert not list((tmp_path / "out").glob("*.tmp"))
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:  # both CPUs free again, long before a blocked task would end by itself: the tasks were cancelled
        deadline = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == 2
    finally:
        ray.shutdown()


def test_doctor_names_ray_and_the_cluster_it_would_join(cluster, monkeypatch, capsys):
    from fastpipe.doctor import run_doctor

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    run_doctor()
    out = capsys.readouterr().out
    assert f"{ray.__version__}; `shard --ray` joins the cluster at RAY_ADDRESS={cluster.address} (it answers)" in out


def test_an_address_where_no_cluster_answers_is_said_at_once(data, tmp_path):
    """Ray's own client tries a wrong address for minutes; the run says so at once, with what to give instead."""
    from fastpipe.errors import ConfigError

    src, kw, _ = data
    with pytest.raises(ConfigError, match=r"cannot join the Ray cluster at 127\.0\.0\.1:9: .* does not answer"):
        shard(ShardConfig(src, tmp_path / "out", ray_address="127.0.0.1:9", **kw))


@pytest.mark.parametrize("server", ["http", "silent"])
def test_an_address_that_answers_but_not_as_ray_is_said_in_one_line(folder, tmp_path, monkeypatch, capsys, server):
    """RAY_ADDRESS at a port that takes connections but is not Ray (a web server; one that says nothing): Ray's
    client waited for minutes. The run stops within --ray-timeout, in one line naming the address."""
    import socket

    from fastpipe.cli import main
    from fastpipe.testing.devserver import FolderServer

    with FolderServer(tmp_path) as web, socket.create_server(("127.0.0.1", 0)) as silent:  # silent: never answers
        port = web.rsplit(":", 1)[1] if server == "http" else silent.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        code = main(["shard", str(folder), str(tmp_path / "out"), "--ray", "--ray-timeout", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.match(rf"fastpipe shard: error: cannot join the Ray cluster at 127\.0\.0\.1:{port}: it takes "
                    rf"connections but does not answer as a Ray cluster within 2 s", err), err
    assert not ray.is_initialized()


def test_the_progress_board_ends_with_the_process_that_made_it(cluster):
    """A run killed with its process group (SIGKILL: no clean-up runs) left its progress actor's process behind. The
    board watches the process that made it: here a stand-in process, killed while this one (the actor's owner in
    Ray's eyes) goes on; the board ends with it."""
    import socket
    import subprocess

    import psutil
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from fastpipe.convert.raycluster import Board

    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        here = ray.get_runtime_context().get_node_id()
        made_by = (here, socket.gethostname(), run.pid, psutil.Process(run.pid).create_time())
        board = Board.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(made_by)
        assert ray.get(board.snapshot.remote(), timeout=TIMEOUT / 2) == (0, 0)  # there, while the run lives
        run.kill()
        run.wait()
        deadline = time.monotonic() + TIMEOUT / 2
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(board.snapshot.remote(), timeout=TIMEOUT / 2)
                time.sleep(0.5)
    finally:
        run.kill()
        ray.shutdown()


def test_tasks_grow_to_about_a_second_of_work():
    """A task starts with the few items it is given, then about TASK_SECONDS of them once results tell their speed
    (Ray's cost per task is then small against its work), never more than MAX_ITEMS, and near the end an equal
    share of what is left per CPU."""
    from fastpipe.convert.onray import MAX_ITEMS, TASK_SECONDS, _Pace

    pace = _Pace(4)
    assert pace.items(1000, 2) == 4
    pace.took(4, 0.4)  # 0.1 s an item
    assert pace.items(1000, 2) == round(TASK_SECONDS / 0.1)
    pace.took(6, 0.4)  # 0.08 s an item, over all results so far
    assert pace.items(1000, 2) == round(TASK_SECONDS / 0.08)
    fast = _Pace(4)
    fast.took(8, 0.0008)
    assert fast.items(1000, 2) == MAX_ITEMS
    slow = _Pace(4)
    slow.took(4, 40.0)  # 10 s an item: never below the first size
    assert slow.items(1000, 2) == 4
    ending = [pace.items(left, 2) for left in (25, 12, 6, 3, 1)]  # the last tasks shrink so that the CPUs end together
    assert ending == [12, 6, 3, 2, 1]


def test_retries_are_counted_per_task_from_the_board_and_the_results():
    """The board's record of a try whose worker died at once may never arrive, and a task that died on every try
    returns no result: per task, the larger of the two counts."""
    from fastpipe.convert.onray import _runs_again

    lost_record, died_each_time = 1, 2
    assert _runs_again({lost_record: 0, died_each_time: 3}, {lost_record: 1}) == 4
    assert _runs_again({}, {}) == 0


def test_a_node_with_other_image_libraries_or_another_build_is_refused():
    """Every result names its node's fastpipe, Pillow and libjpeg-turbo; one that differs from this machine's, or a
    result in another build's shape, stops the run naming the node: the shards would depend on where photos went."""
    from fastpipe.convert.onray import CODECS, RayWorkers
    from fastpipe.errors import ConfigError

    pool = object.__new__(RayWorkers)  # the result checks alone, without joining a cluster
    pool.again, pool.tasks, pool.nodes_used = {}, 0, set()
    assert pool._checked((CODECS, "node-a", ["jpeg"], 0.1, 7, 2)) == ["jpeg"]
    assert pool.again == {7: 2} and pool.nodes_used == {"node-a"}
    with pytest.raises(ConfigError, match=r"Ray node node-b converts with .* \(another build\), this machine"):
        pool._checked((CODECS, "node-b", ["jpeg"], 0.1, 2))
    with pytest.raises(ConfigError, match=r"Ray node node-c converts with fastpipe 0\.0\.1, Pillow 9\.0"):
        pool._checked(("fastpipe 0.0.1, Pillow 9.0, libjpeg-turbo 2.0", "node-c", [], 0.1, 3, 0))


def test_a_photo_replaced_after_hashing_is_rejected_on_ray_as_in_one_process(cluster, tmp_path, monkeypatch):
    """Each task is given the photos with the hashes the plan made them with (photos.Planned): one replaced after it
    was hashed, before the tasks read it, is a `changed` rejection on the nodes too, not converted as it now is."""
    import json

    from conftest import make_folder

    from fastpipe.convert import plan

    src = make_folder(tmp_path / "src", {"red": 4, "blue": 3})
    hash_files = plan.hash_files

    def hashed_then_replaced(*args, **kw):
        found = hash_files(*args, **kw)
        (src / "red" / "img_001.jpg").write_bytes((src / "blue" / "img_000.jpg").read_bytes())
        return found

    monkeypatch.setattr(plan, "hash_files", hashed_then_replaced)
    summary = shard(ShardConfig(src, tmp_path / "out", short_side=32, val_fraction=0.25, ray_address=cluster.address))
    assert dict(summary.rejected) == {"changed": 1} and sum(summary.written.values()) == 6
    (rejection,) = map(json.loads, (tmp_path / "out" / "rejected.jsonl").read_text().splitlines())
    assert rejection["path"] == "red/img_001.jpg" and "changed after they were hashed" in rejection["detail"]

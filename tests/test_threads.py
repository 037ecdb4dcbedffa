"""Loader workers as threads of the training process: the process mode's batches bit for bit, no shared memory, the
default where the decoder releases the GIL, and no thread left running however an epoch ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_loaders import KW

from fastpipe import make_loader
from fastpipe.errors import ConfigError
from fastpipe.loaders import cpu_ops, jpegcrop
from fastpipe.loaders.prepare import CpuDecode
from fastpipe.loaders.threads import running


def _epoch(loader, e=0):
    loader.set_epoch(e)
    return [(x.clone(), y, [str(k) for k in keys]) for x, y, keys in loader]


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya, ka), (xb, yb, kb) in zip(a, b):
        assert ka == kb and torch.equal(ya, yb) and torch.equal(xa, xb)


@pytest.mark.parametrize("split", ["train", "val"])
def test_threads_give_the_process_modes_batches_bit_for_bit_and_resume_alike(converted, split):
    kw = {**KW, "split": split, "seed": 7, "normalize": False, "with_keys": True, "num_workers": 2}
    threads, processes = make_loader(converted, threads=True, **kw), make_loader(converted, threads=False, **kw)
    assert threads.describe()["workers_are"] == "threads" and processes.describe()["workers_are"] == "processes"
    for e in (0, 1):
        _same(_epoch(threads, e), _epoch(processes, e))
    if split == "train":  # stopped after 3 batches in thread mode, resumed by 3 worker processes
        threads.set_epoch(2)
        it = iter(threads)
        first = [(x.clone(), y, [str(k) for k in keys]) for _, (x, y, keys) in zip(range(3), it)]
        state = threads.state_dict()
        it.close()
        rest = make_loader(converted, threads=False, **{**kw, "num_workers": 3})
        rest.load_state_dict(state)
        _same(first + [(x.clone(), y, [str(k) for k in keys]) for x, y, keys in rest], _epoch(processes, 2))
        rest.close()
    processes.close()
    assert not running()


def test_the_default_is_threads_where_the_decoder_releases_the_gil(converted):
    default = make_loader(converted, num_workers=2, **KW)
    pillow = make_loader(converted, num_workers=2, cpu_decoder="pillow", **KW)
    nvjpeg = make_loader(converted, "nvjpeg", num_workers=2, **KW)
    assert default.in_threads == (cpu_ops.cv2 is not None)  # crop decoder or simplejpeg, + OpenCV
    assert not pillow.in_threads and not nvjpeg.in_threads
    assert not make_loader(converted, num_workers=0, threads=True, **KW).in_threads  # 0: in the training process
    with pytest.raises(ConfigError, match=r"threads='on': use True \(worker threads\), False"):
        make_loader(converted, threads="on", **KW)



@pytest.mark.skipif(cpu_ops.cv2 is None, reason="needs a decoder that releases the GIL")
def test_many_workers_are_processes_by_default_unless_dev_shm_is_too_small(converted, monkeypatch):
    """Past DEFAULT_THREADS_UP_TO workers the threads would queue on the GIL: processes, unless /dev/shm cannot hold
    their batches (a container's 64 MB), where processes would be cut down to fit and threads win."""
    from fastpipe.loaders import workers

    many = workers.DEFAULT_THREADS_UP_TO + 1
    kw = {**KW, "batch_size": 64, "image_size": 224}  # 9.6 MB a batch
    monkeypatch.setattr(workers, "shm_free", lambda path=workers.SHM: 64 << 30)
    assert make_loader(converted, num_workers=workers.DEFAULT_THREADS_UP_TO, **kw).in_threads
    assert not make_loader(converted, num_workers=many, **kw).in_threads
    assert make_loader(converted, num_workers=many, threads=True, **kw).in_threads  # asked for: as asked
    monkeypatch.setattr(workers, "shm_free", lambda path=workers.SHM: 64 << 20)
    loader = make_loader(converted, num_workers=many, **kw)
    assert loader.in_threads and loader.num_workers == many


def test_the_threads_share_each_batch(converted, monkeypatch):
    """One batch is decoded by every thread at once: the first batch comes after a part of one batch's decode, and
    no thread idles while another makes the epoch's last batch."""
    who, real = {}, CpuDecode.part  # the batch's first sample id -> threads that decoded a part of it

    def part(self, job, *a):
        who.setdefault(int(job.raw.ids[0]), set()).add(threading.current_thread().name)
        return real(self, job, *a)

    monkeypatch.setattr(CpuDecode, "part", part)
    first, real_decode = threading.Event(), CpuDecode._decode

    def decode(self, *a):  # the first decode waits (for an event, at most 60 s) until a second thread has a part
        if not first.is_set():
            first.set()
            for _ in range(600):
                if len(set().union(*who.values())) > 1:
                    break
                threading.Event().wait(0.1)
        return real_decode(self, *a)

    monkeypatch.setattr(CpuDecode, "_decode", decode)

    monkeypatch.setattr(jpegcrop, "chunked", lambda: False)  # every sample through _decode
    loader = make_loader(converted, num_workers=2, threads=True, **{**KW, "batch_size": 16, "split": "val"})
    it = iter(loader)
    next(it)
    it.close()
    assert len(who[0]) == 2  # both threads decoded samples of the first batch

def test_a_thread_mode_loader_uses_no_shared_memory(converted, monkeypatch):
    """torch's shared memory made to fail, as where /dev/shm is missing or full: threads do not touch it."""
    def refused(*_a, **_k):
        raise RuntimeError("unable to allocate shared memory")

    monkeypatch.setattr(torch.Tensor, "share_memory_", refused)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", refused)
    with pytest.raises(RuntimeError, match="shared memory"):  # what worker processes need
        make_loader(converted, num_workers=2, threads=False, **KW)
    loader = make_loader(converted, num_workers=2, threads=True, **KW)
    for e in range(2):
        loader.set_epoch(e)
        assert sum(len(y) for _, y in loader) == len(loader) * KW["batch_size"]


SHM_SCRIPT = """
import sys, torch
from fastpipe import make_loader
try:
    torch.zeros(1).share_memory_()
    print("SHARED MEMORY WORKS")
except RuntimeError:
    pass
loader = make_loader(sys.argv[1], "torch", batch_size=8, image_size=48, num_workers=2, threads=True, device="cpu")
n = 0
for epoch in range(2):
    loader.set_epoch(epoch)
    n += sum(len(y) for _, y in loader)
maps = [line for line in open("/proc/self/maps") if "/dev/shm/" in line]
print("SAMPLES", n, "BATCHES", 2 * len(loader), "SHM MAPS", len(maps))
"""


def test_each_epochs_threads_read_a_folders_shards_through_the_maps_made_once(converted, monkeypatch):
    """Every epoch's threads read through copies of the data set's shards: a folder's are mapped in the first epoch
    and never again (a store's copies start without maps: test_remote)."""
    import mmap as mmap_module

    loader = make_loader(converted, num_workers=2, threads=True, **KW)
    first = [y for _, y in loader]
    mapped, real = [], mmap_module.mmap
    monkeypatch.setattr(mmap_module, "mmap", lambda *a, **k: mapped.append(a) or real(*a, **k))
    loader.set_epoch(1)
    assert sum(len(y) for _, y in loader) == sum(len(y) for y in first)
    assert not mapped


def test_two_threads_mapping_one_shard_at_once_count_it_once(converted, monkeypatch):
    """A folder's ShardSet and its copies (each epoch's threads) share their maps: a shard two of them map at once is
    mapped once, and the count of shards left to map stays right, so no batch is read through a missing map."""
    import copy

    from fastpipe.dataset.loading import load
    from fastpipe.loaders.shards import ShardSet

    shards = ShardSet(load(converted), "train")
    other = copy.copy(shards)
    entered, go, again, calls, real = threading.Event(), threading.Event(), threading.Event(), [], ShardSet._map

    def slow_map(self, shard):
        calls.append(shard)
        if len(calls) == 1:
            entered.set()
            go.wait(10)
        else:
            again.set()
        return real(self, shard)

    monkeypatch.setattr(ShardSet, "_map", slow_map)
    first = threading.Thread(target=shards._view, args=(0, 0, 0))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=other._view, args=(0, 0, 0))
    second.start()
    again.wait(0.5)  # without the lock, the second thread maps it too
    go.set()
    first.join()
    second.join()
    assert calls == [0] and shards._views[0] is not None
    assert int(shards._unmapped[0]) == len(shards.paths) - 1


def test_threads_run_where_dev_shm_is_read_only(converted, tmp_path):
    """A real /dev/shm nothing can be written to, in a private mount namespace."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m (root) to mount a read-only /dev/shm")
    (tmp_path / "run.py").write_text(SHM_SCRIPT)
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro,size=64k tmpfs /dev/shm && "
                        f"{sys.executable} {tmp_path / 'run.py'} {converted}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SHARED MEMORY WORKS" not in r.stdout  # the environment does bite
    n, batches = int(r.stdout.split("SAMPLES ")[1].split()[0]), int(r.stdout.split("BATCHES ")[1].split()[0])
    assert n == 8 * batches > 0 and "SHM MAPS 0" in r.stdout, r.stdout


def test_no_thread_outlives_an_epoch_however_it_ends(converted, monkeypatch):
    loader = make_loader(converted, num_workers=2, threads=True, **{**KW, "batch_size": 2})
    assert len(list(loader)) == len(loader) and not running()  # the end of the epoch
    for _ in loader:  # the caller leaves the loop
        assert running()
        break
    assert not running()
    it = iter(loader)
    next(it)
    loader.close()  # closed while the threads are ahead
    assert not running()
    calls = []

    def bug(self, *a):
        calls.append(1)
        if len(calls) > 3:
            raise ZeroDivisionError("a bug in a decoder")
        return real(self, *a)

    real = CpuDecode.part  # the batch's machinery, not a sample's decode (a sample that fails is skipped)
    monkeypatch.setattr(CpuDecode, "part", bug)
    with pytest.raises(ZeroDivisionError, match="a bug in a decoder"):  # as it is, with its traceback
        list(loader)
    assert not running()


def test_the_earliest_bad_sample_of_a_batch_is_the_one_named_whichever_thread_fails_first(converted, monkeypatch):
    """on_error="raise": two bad samples in one batch, in chunks decoded by different threads, the later one failing
    first (held by an event): the error names the earlier sample, as one process decoding in order finds it."""
    import numpy as np

    from fastpipe.dataset.loading import load
    from fastpipe.errors import DataError
    from fastpipe.loaders.shards import ShardSet
    from fastpipe.loaders.threads import CHUNK

    raw = ShardSet(load(converted), "val").read(np.arange(2 * CHUNK))  # the first val batch
    early, late = bytes(raw.images[2]), bytes(raw.images[CHUNK + 2])
    late_failed, real = threading.Event(), CpuDecode._decode

    def decode(self, image, *a):
        if bytes(image) == late:
            late_failed.set()
            raise ValueError("bad pixels")
        if bytes(image) == early:
            late_failed.wait(60)
            raise ValueError("bad pixels")
        return real(self, image, *a)

    monkeypatch.setattr(CpuDecode, "_decode", decode)

    monkeypatch.setattr(jpegcrop, "chunked", lambda: False)  # every sample through _decode
    loader = make_loader(converted, num_workers=2, threads=True, on_error="raise",
                         **{**KW, "batch_size": 2 * CHUNK, "split": "val"})
    with pytest.raises(DataError) as said:
        list(loader)
    assert late_failed.is_set() and raw.name(2) in str(said.value) and raw.name(CHUNK + 2) not in str(said.value)
    assert not running()


def test_an_iteration_closed_by_a_newer_one_ends_instead_of_waiting(converted):
    """A new iteration of the loader ends the threads of the one before: taking a batch from the older iterator then
    ends it (it does not wait for threads that are gone, nor hand out a batch whose buffer is reused)."""
    loader = make_loader(converted, num_workers=2, threads=True, **{**KW, "batch_size": 2})
    older = iter(loader)
    next(older)
    newer = iter(loader)
    next(newer)
    rest, said = [], []

    def take():
        try:
            rest.extend(older)
        except RuntimeError as e:
            said.append(str(e))

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(60)  # a bound for the failure this guards against (waiting forever), not a timing
    assert not taker.is_alive() and rest == [] and "was ended by a newer one" in said[0]
    assert len(list(newer)) == len(loader) - 1
    assert not running()


def test_ctrl_c_while_the_threads_decode_stops_them_all(converted, monkeypatch):
    """Ctrl-C reaches the training process's main thread while it waits for a batch and the threads are inside a
    decode (held there by an event, not a time); the epoch ends with KeyboardInterrupt and no thread left."""
    inside, release = threading.Event(), threading.Event()
    real = CpuDecode._decode

    def held(self, *a):
        inside.set()
        release.wait(60)
        return real(self, *a)

    monkeypatch.setattr(CpuDecode, "_decode", held)

    monkeypatch.setattr(jpegcrop, "chunked", lambda: False)  # every sample through _decode
    main = threading.main_thread().ident

    def interrupt():
        inside.wait(60)
        signal.pthread_kill(main, signal.SIGINT)
        release.set()

    loader = make_loader(converted, num_workers=2, threads=True, **KW)
    helper = threading.Thread(target=interrupt)
    helper.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    helper.join(60)
    assert inside.is_set() and not running()


def test_pin_memory_for_a_cpu_device_is_left_out_as_worker_processes_do(converted):
    """Pinned memory serves copies to a CUDA device only; without a driver, allocating it fails."""
    loader = make_loader(converted, num_workers=2, threads=True, pin_memory=True, **KW)
    assert sum(len(y) for _, y in loader) == len(loader) * KW["batch_size"] and not loader.buffers.pin


def test_bench_builds_its_loaders_in_the_mode_asked(converted):
    """`fastpipe bench --threads on,off`: each row's loader has the workers its row says."""
    from fastpipe.bench.config import BenchConfig
    from fastpipe.bench.parts import loader
    from fastpipe.dataset.loading import load

    m = load(converted)
    rows = {t: loader(BenchConfig(data=str(converted), device="cpu", workers=2, threads=t, batch_size=8,
                                  image_size=48), m) for t in (True, False)}
    assert rows[True].in_threads and not rows[False].in_threads


def test_threads_in_a_helper_process_give_the_same_batches(converted):
    """threads='helper': the thread pool in one helper process, its batches handed over through shared memory; the
    same batches as the threads', and a run stopped in it resumes in threads where it stopped."""
    kw = {**KW, "seed": 7, "normalize": False, "with_keys": True, "num_workers": 2}
    helper, threads = make_loader(converted, threads="helper", **kw), make_loader(converted, threads=True, **kw)
    assert helper.describe()["workers_are"] == "threads in a helper process"
    for e in (0, 1):
        _same(_epoch(helper, e), _epoch(threads, e))
    helper.set_epoch(2)  # stopped after 3 batches, resumed by worker threads
    it = iter(helper)
    first = [(x.clone(), y, [str(k) for k in keys]) for _, (x, y, keys) in zip(range(3), it)]
    state = helper.state_dict()
    it.close()
    rest = make_loader(converted, threads=True, **kw)
    rest.load_state_dict(state)
    _same(first + [(x.clone(), y, [str(k) for k in keys]) for x, y, keys in rest], _epoch(threads, 2))
    helper.close()


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(cpu_ops.cv2 is None, reason="needs a decoder that releases the GIL (threads by default)")
@pytest.mark.parametrize("python_never_pauses", [True, False])
def test_a_step_whose_python_never_pauses_moves_the_default_to_processes(converted, tmp_path, capfd,
                                                                          python_never_pauses):
    """The default's threads share the GIL with the training step: a step that keeps its thread busy (pure Python
    here) while the loop waits for data (a store's latency here) trains faster with worker processes, from the
    second epoch on, with the same batches; a step that sleeps (the device working) keeps the threads."""
    from fastpipe.testing.devserver import Faults, FolderServer

    kw = {**KW, "seed": 3, "normalize": False, "with_keys": True, "num_workers": 2, "batch_size": 8}
    with FolderServer(converted, Faults(latency=0.05, only=".tar")) as url:
        loader = make_loader(url, cache_dir=tmp_path / "cache", **kw)
        assert loader.describe()["workers_are"] == "threads"
        loader.set_epoch(0)
        for _ in loader:
            _spin(12) if python_never_pauses else time.sleep(0.012)
        share = loader.stats.step_cpu_share()
        assert (share > 0.8) if python_never_pauses else (share < 0.3), share
        second = _epoch(loader, 1)
        want = "processes" if python_never_pauses else "threads"
        assert loader.describe()["workers_are"] == want
        loader.close()
    _same(second, _epoch(make_loader(converted, threads=True, **kw), 1))
    said = capfd.readouterr().err
    assert ("worker processes from epoch 2 on" in said) == python_never_pauses, said


@pytest.mark.skipif(cpu_ops.cv2 is None, reason="needs a decoder that releases the GIL (threads by default)")
@pytest.mark.parametrize("faster", [True, False])
def test_a_busy_step_beside_a_loader_that_keeps_up_tries_processes_for_one_epoch(converted, capfd, monkeypatch,
                                                                                 faster):
    """A step whose Python never pauses, and a loop that did not wait for batches: one epoch in worker processes,
    kept where the loop ran 3 % faster in it, else threads again; the batches are the same throughout. The rates
    are stand-ins (what a busy machine makes of them is not what this checks)."""
    from fastpipe.loaders import stats, workers

    monkeypatch.setattr(stats, "WAIT_FREE", 2.0)  # the loop never counts as having waited: the trial decides
    monkeypatch.setattr(workers, "STEP_PYTHON", 0.0)  # and a busy machine's share of the step does not matter
    rates = iter([10.0, 10.5 if faster else 10.2])  # batches/s: the threads' epoch, then the processes'
    monkeypatch.setattr(stats.LoaderStats, "loop_rate", lambda self: next(rates))
    kw = {**KW, "seed": 3, "normalize": False, "with_keys": True, "num_workers": 2, "batch_size": 8}
    loader = make_loader(converted, **kw)
    loader.set_epoch(0)
    for _ in loader:
        _spin(12)
    trial = _epoch(loader, 1)
    assert loader.describe()["workers_are"] == "processes"
    after = _epoch(loader, 2)
    assert loader.describe()["workers_are"] == ("processes" if faster else "threads")
    loader.close()
    threads = make_loader(converted, threads=True, **kw)
    _same(trial, _epoch(threads, 1))
    _same(after, _epoch(threads, 2))
    said = capfd.readouterr().err
    assert "epoch 2 in worker processes, to compare with the threads" in said, said
    assert f"{'worker processes' if faster else 'threads'} from epoch 3 on" in said, said


def test_a_killed_helper_process_is_named_not_waited_for(converted):
    """The helper process killed (the out-of-memory killer) mid-epoch: the loop gets an error naming it, at once."""
    loader = make_loader(converted, "torch", batch_size=4, image_size=32, num_workers=2, threads="helper",
                         device="cpu")
    it = iter(loader)
    next(it)
    helper = loader.dataloader._iterator._workers[0]
    os.kill(helper.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {helper.pid}\) exited unexpectedly"):
        for _ in it:
            pass
    loader.close()


HELPER_INTERRUPTED = """
import os, signal, sys
from fastpipe import make_loader
loader = make_loader(sys.argv[1], "torch", batch_size=4, image_size=32, num_workers=2, threads="helper", device="cpu")
it = iter(loader)
next(it)
print(loader.dataloader._iterator._workers[0].pid, flush=True)
try:
    os.kill(os.getpid(), signal.{sig})
    for _ in it:
        pass
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_with_a_helper_process_leaves_nothing_behind(converted, sig):
    """Ctrl-C or SIGTERM in the training process: it ends, and so does the helper process, its shared memory gone."""
    before = set(os.listdir("/dev/shm"))
    r = subprocess.run([sys.executable, "-c", HELPER_INTERRUPTED.replace("{sig}", sig), str(converted)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (130, -signal.SIGTERM, 128 + signal.SIGTERM), r.stderr[-2000:]
    helper = int(r.stdout.split()[0])
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{helper}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{helper}")
    assert set(os.listdir("/dev/shm")) - before == set()

"""Loader worker processes: they survive signals meant for the training process, obey their own main process, and
never keep the interpreter from exiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from test_loaders import KW, _corrupt_one_sample

from fastpipe import make_loader
from fastpipe.dataset.loading import load
from fastpipe.loaders.epoch import batches_per_epoch


def test_workers_ignore_a_foreign_sigterm_but_obey_their_main_process(converted):
    loader = make_loader(converted, "torch", num_workers=2, threads=False, **KW)
    it = iter(loader)
    next(it)
    workers = loader.dataloader._iterator._workers  # this loader's own processes
    assert len(workers) == 2
    for w in workers:  # as Slurm or `kill -- -PGID` would: from another process
        subprocess.run(["kill", "-TERM", str(w.pid)], check=True)
    time.sleep(0.5)
    rest = sum(1 for _ in it)
    assert rest + 1 == batches_per_epoch("train", load(converted).splits["train"].samples, 8, 1)
    assert all(w.is_alive() for w in workers)
    os.kill(workers[0].pid, signal.SIGTERM)  # DataLoader's own fallback, from this process: obeyed
    workers[0].join(timeout=20)
    assert not workers[0].is_alive()
    loader.close()
    workers[1].join(timeout=20)
    assert not workers[1].is_alive()



@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_foreign_sigterm_while_the_workers_start_does_not_kill_them(converted, monkeypatch, start):
    """torchrun's or Slurm's SIGTERM to the process group can arrive while the worker processes are being forked,
    before they have set up who may end them: sent from another process the moment they exist, it waits until they
    have (it killed them before). Also where they fork from a server process (this process holding DALI)."""
    import types

    import torch.utils.data.dataloader as dataloader

    if start == "forkserver":  # what processes.worker_context looks for
        monkeypatch.setitem(sys.modules, "nvidia.dali", sys.modules.get("nvidia.dali") or types.ModuleType("dali"))
    else:
        monkeypatch.delitem(sys.modules, "nvidia.dali", raising=False)

    started = dataloader._MultiProcessingDataLoaderIter.__init__

    def and_signalled(self, *a, **k):
        started(self, *a, **k)
        for w in self._workers:
            subprocess.run(["kill", "-TERM", str(w.pid)], check=True)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "__init__", and_signalled)
    loader = make_loader(converted, "torch", num_workers=2, threads=False, **KW)
    assert sum(1 for _ in loader) == len(loader)
    workers = loader.dataloader._iterator._workers
    assert all(w.is_alive() for w in workers)
    loader.close()

def test_an_error_kept_in_a_reference_cycle_does_not_hang_the_exit(converted, tmp_path):
    """The CI hang: an epoch abandoned by an exception whose traceback sat in a cycle left workers that the
    garbage collector could not stop, and the interpreter waited for them at exit."""
    import shutil

    out = tmp_path / "bad"
    shutil.copytree(converted, out)
    _corrupt_one_sample(out)
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(f"""
        import gc
        from fastpipe import make_loader
        if __name__ == "__main__":
            loader = make_loader({str(out)!r}, "torch", num_workers=2, threads=False, on_error="raise",
                                 batch_size=1, image_size=48, device="cpu")
            kept = []
            try:
                list(loader)
            except Exception as e:
                kept.append((e, kept))
            del loader, kept
            gc.collect()
            print("exiting")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "exiting" in r.stdout, r.stderr[-2000:]


def test_a_worker_batch_crosses_with_only_its_images_in_shared_memory():
    """What a worker queues: the pooled image buffer travels as a shared-memory handle, the small tensors and
    encoded bytes by value (each shared tensor costs a file-descriptor handshake), and all arrive as they left."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import numpy as np
    import torch
    import torch.multiprocessing  # registers torch's reducers with ForkingPickler, as in a DataLoader worker

    from fastpipe.loaders.batch import HostBatch

    images = torch.zeros((2, 4, 4, 3), dtype=torch.uint8).share_memory_()
    sent = HostBatch(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([7, 9]), images=images,
                     data=[torch.tensor([255, 216], dtype=torch.uint8)] * 2, boxes=torch.tensor([[0, 0, 4, 4]] * 2),
                     flips=torch.tensor([True, False]), skipped=["a/b: bad"], slot=3, io=(1, 2, 0))
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(sent)
    got = pickle.loads(buf.getvalue())
    assert got.images.data_ptr() == images.data_ptr()  # the same buffer, not a copy (same process here)
    for name in ("labels", "ids", "boxes", "flips"):
        assert torch.equal(getattr(got, name), getattr(sent, name))
        assert getattr(got, name).dtype == getattr(sent, name).dtype and not getattr(got, name).is_shared()
    assert all(isinstance(d, torch.Tensor) and torch.equal(d, e) for d, e in zip(got.data, sent.data))
    assert (got.skipped, got.slot, got.io) == (sent.skipped, sent.slot, sent.io)
    raw = HostBatch(torch.tensor([1]), torch.tensor([2]), data=[np.frombuffer(b"\xff\xd8", np.uint8)])  # DALI's
    assert isinstance(pickle.loads(ForkingPickler.dumps(raw)).data[0], np.ndarray)

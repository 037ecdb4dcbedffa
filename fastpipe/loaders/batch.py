"""What a loader worker hands to the training step: a HostBatch, and the pooled buffers it is made in (shared memory
for worker processes, plain or pinned memory for worker threads)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch.utils.data import get_worker_info


@dataclass
class HostBatch:
    """One batch on the host. Which fields are set depends on the backend's preparation (prepare.py):
    decoded images (torch), encoded bytes with crop boxes (nvjpeg), or encoded bytes for DALI."""

    labels: torch.Tensor  # int64 (n,)
    ids: torch.Tensor  # int64 (n,): global sample ids, from which the main process names samples (keys)
    images: torch.Tensor | None = None  # uint8 NHWC
    data: list | None = None  # encoded images, one per sample
    boxes: torch.Tensor | None = None  # int64 (n, 4): crop x0, y0, x1, y1
    flips: torch.Tensor | None = None  # bool (n,)
    skipped: list[str] = field(default_factory=list)  # "shard/key: why" for samples that failed to decode
    slot: int = -1  # the pooled buffer holding `images`, to release once copied (BufferPool)
    error: str | None = None  # a worker's FastpipeError, re-raised by the main process with this message
    io: tuple[int, int, int] | None = None  # remote data: (requests, bytes, retries) since the last batch
    stages: dict[str, float] | None = None  # seconds the workers spent on it, per stage (LoaderStats.stages)

    def __reduce__(self):
        """From a worker to the main process: `images` (a pooled shared-memory buffer) by handle, as torch sends a
        tensor; every other tensor by value. torch would put each in a new shared-memory segment and pass its file
        descriptor over a socket with an authentication handshake, two per batch (labels, ids) and one per sample
        for encoded bytes: more work for both processes than pickling the few bytes (benchmarks/bench_crop.py)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in _BY_VALUE:
            if isinstance(state[k], torch.Tensor):
                state[k] = state[k].numpy()
        tensors = bool(state["data"]) and isinstance(state["data"][0], torch.Tensor)
        if tensors:
            state["data"] = [d.numpy() for d in state["data"]]
        return _rebuild, (state, tensors)

    def pin_memory(self) -> HostBatch:
        """DataLoader's pin-memory thread calls this for objects it does not know."""
        return replace(self, labels=self.labels.pin_memory(),
                       images=self.images.pin_memory() if self.images is not None else None)

    @staticmethod
    def failed(message: str) -> HostBatch:
        empty = torch.zeros(0, dtype=torch.int64)
        return HostBatch(empty, empty, error=message)


_BY_VALUE = ("labels", "ids", "boxes", "flips")


def _rebuild(state: dict, tensors: bool) -> HostBatch:
    for k in _BY_VALUE:
        if isinstance(state[k], np.ndarray):
            state[k] = torch.from_numpy(state[k])
    if tensors:
        state["data"] = [torch.from_numpy(d) for d in state["data"]]
    return HostBatch(**state)


_thread = threading.local()  # a loader thread's (worker id, worker count): threads.py sets it


def worker_info() -> tuple[int, int] | None:
    """(id, count) of the loader worker this code runs in, a DataLoader worker process or a loader thread; None in
    the training process's own decoding (num_workers=0)."""
    thread = getattr(_thread, "worker", None)  # first: threads in a helper process are workers of their own
    if thread is not None:
        return thread
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else None


def set_worker_thread(worker: int, workers: int) -> None:
    _thread.worker = (worker, workers)


@dataclass(frozen=True)
class SampleKey:
    """Which sample an image is, and the file it was converted from (`make_loader(..., with_keys=True)`)."""

    shard: str
    key: str
    source: str | None = None
    id: int = -1  # the sample's position in its split (ShardSet.sample(id) reads it again)

    def __str__(self) -> str:
        return f"{self.shard}/{self.key}" + (f" ({self.source})" if self.source else "")


class BufferPool:
    """uint8 NHWC batch buffers, one pool per loader worker, reused once released.

    A fresh 10 MB buffer per batch costs its first-touch page faults (about a fifth of the decode time here:
    benchmarks/bench_loaders.py). So each worker keeps up to `ring` buffers and reuses one only after the training
    process has released it explicitly, through a flag: once it has copied the batch out (into a float tensor, or
    a device copy), or, where the caller gets the buffer itself (uint8 output on the CPU), once the caller's last
    view of it is gone (`lend`). Nothing depends on the workers' scheduling or on the caller's habits: a batch kept
    for as long as you like stays intact, and when no buffer is free a fresh one is allocated.

    `shared`: worker processes, whose buffers and flags live in shared memory and cross to the training process
    without a copy. Otherwise (worker threads) nothing is shared memory; `pin`: the buffers are pinned, so that the
    copy to a CUDA device starts from them directly.
    """

    def __init__(self, workers: int, ring: int, batch: int, size: int, shared: bool = True, pin: bool = False):
        self.shape, self.ring, self.shared, self.pin = (batch, size, size, 3), ring, shared, pin
        self.free = torch.zeros((max(workers, 1), max(ring, 1)), dtype=torch.int8)
        if shared:
            self.free.share_memory_()
        self._flags = self.free.numpy()  # the same memory: reading and setting a flag through numpy is 50x cheaper
        self.pools: dict[int, list[torch.Tensor]] = {}  # each worker's buffers, filled by that worker
        self.lent: set[int] = set()  # training process: slots whose buffer the caller still holds

    def __getstate__(self):  # to a worker process: the flags' numpy view is made again over the shared tensor
        return {k: v for k, v in self.__dict__.items() if k != "_flags"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._flags = self.free.numpy()

    def _new(self) -> torch.Tensor:
        if not self.shared or get_worker_info() is None:
            return torch.empty(self.shape, dtype=torch.uint8, pin_memory=self.pin)
        storage = torch.UntypedStorage._new_shared(int(np.prod(self.shape)))
        return torch.tensor([], dtype=torch.uint8).set_(storage).view(self.shape)

    def take(self) -> tuple[torch.Tensor, int]:
        """A buffer and its slot id (-1: not pooled, never released)."""
        me = worker_info()
        if me is None and not self.shared:  # decoded in the training process (num_workers=0): worker 0's pool
            me = (0, 1)
        if me is None or not self.ring:
            return self._new(), -1
        flags, pool = self._flags[me[0]], self.pools.setdefault(me[0], [])
        for slot, buffer in enumerate(pool):
            if flags[slot] == 1:
                flags[slot] = 0
                return self._handed(buffer), me[0] * self.ring + slot
        if len(pool) < self.ring:
            pool.append(self._new())
            flags[len(pool) - 1] = 0
            return self._handed(pool[-1]), me[0] * self.ring + len(pool) - 1
        return self._new(), -1

    def _handed(self, buffer: torch.Tensor) -> torch.Tensor:
        """The pooled buffer as this batch's own tensor: worker threads hand it to the caller as it is, so that its
        life (and its views', whose base it is) is this batch's alone, as a worker process's batch arriving in the
        training process is (see `lend`)."""
        if self.shared:
            return buffer
        return buffer.detach()  # the same memory, no _base: a tensor of its own, as set_() on the storage gives

    def release(self, slot: int) -> None:
        if slot >= 0:
            self._flags.reshape(-1)[slot] = 1

    def lend(self, images: torch.Tensor, slot: int) -> None:
        """The caller gets `images` (the training process's tensor over the slot's memory) itself: the slot is
        released when that tensor, or the batch's own tensor it is a view of, is freed. Every view (a slice, a
        permute, `.numpy()`) keeps it alive through `_base`, so no view can see the buffer rewritten."""
        if slot >= 0:
            self.lent.add(slot)
            root = images if images._base is None else images._base  # a batch is the first rows of its buffer
            weakref.finalize(root, self._returned, slot).atexit = False

    def _returned(self, slot: int) -> None:
        self.lent.discard(slot)
        self.release(slot)

    def release_all(self) -> None:
        """Every slot free but those the caller still holds (between epochs: batches abandoned in flight)."""
        self.free.fill_(1)
        for slot in self.lent:
            self.free.view(-1)[slot] = 0

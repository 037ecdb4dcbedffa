"""What a loader worker reads (a RawBatch) and hands to the training step: a HostBatch, and the pooled buffers it is
made in (shared memory for worker processes, plain or pinned memory for worker threads)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch.utils.data import get_worker_info


class RawBatch:
    """The samples of one batch as read, in parallel arrays (no object per sample: the hot path of every worker).
    Sample i's image is views[s][a:b] for (s, a, b) = spans[i] (the shards' memory maps, zero-copy; `images` slices
    them, for the paths that take a list); `labels`: label_array's."""

    __slots__ = ("_images", "ids", "labels", "read_s", "shards", "spans", "views")

    def __init__(self, shards, ids: np.ndarray, views, spans: np.ndarray, labels: np.ndarray, read_s: float = 0.0):
        # shards: the ShardSet it was read from (shards.py, which makes RawBatches)
        self.shards, self.ids, self.views, self.spans, self.labels = shards, ids, views, spans, labels
        self.read_s = read_s  # seconds this read took, waiting for a fetch ahead of it included (loader.stats.stages)
        self._images: list[memoryview] | None = None

    @property
    def images(self) -> list[memoryview]:
        if self._images is None:
            self._images = [self.views[s][a:b] for s, a, b in self.spans.tolist()]
        return self._images

    def __len__(self) -> int:
        return len(self.ids)

    def name(self, i: int) -> str:
        """'sample KEY in shard NAME' of the batch's i-th sample, for messages."""
        sid = int(self.ids[i])
        return f"sample {self.shards.keys[sid]} in shard {self.shards.names[int(self.shards.shard_of(sid))]}"


@dataclass
class HostBatch:
    """One batch on the host. Which fields are set depends on the backend's preparation (prepare.py):
    decoded images (torch), encoded bytes with crop boxes (nvjpeg), or encoded bytes for DALI."""

    # labels, ids and images are numpy arrays as a worker makes them (a worker process's images: its shared tensor),
    # tensors once `tensors()` has run in the training thread
    labels: torch.Tensor  # int64 (n,), or float32 (n, K) multi-hot
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

    def tensors(self) -> HostBatch:
        """The batch's numpy arrays made tensors, in the training thread: there torch's calls are warm, while in a
        worker thread, after a chunk's decode has evicted the CPU's caches, each costs tens of µs holding the GIL
        (benchmarks/profile_worker.py --gil)."""
        for k in ("labels", "ids", "images"):
            v = getattr(self, k)
            if isinstance(v, np.ndarray):
                setattr(self, k, torch.from_numpy(v))
        return self

    def pin_memory(self) -> HostBatch:
        """DataLoader's pin-memory thread calls this for objects it does not know."""
        self.tensors()
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


def worker_id() -> int | None:
    """The id of the DataLoader worker process this code runs in; None in the training process."""
    info = get_worker_info()
    return info.id if info is not None else None


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
        self._flat = self._flags.reshape(-1)  # by slot
        self.pools: dict[int, list[tuple]] = {}  # each worker's buffers (what a batch carries, its array)
        self.lent: set[int] = set()  # training process: slots whose buffer the caller still holds

    def __getstate__(self):  # to a worker process: the flags' numpy views are made again over the shared tensor
        return {k: v for k, v in self.__dict__.items() if k not in ("_flags", "_flat")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._flags = self.free.numpy()
        self._flat = self._flags.reshape(-1)

    def _new(self) -> torch.Tensor:
        if not self.shared or get_worker_info() is None:
            return torch.empty(self.shape, dtype=torch.uint8, pin_memory=self.pin)
        storage = torch.UntypedStorage._new_shared(int(np.prod(self.shape)))
        return torch.tensor([], dtype=torch.uint8).set_(storage).view(self.shape)

    def take(self, worker: int | None = None) -> tuple[torch.Tensor | np.ndarray, np.ndarray, int]:
        """A buffer from the pool of `worker` (a worker thread's number; by default the worker process this runs in):
        what the batch carries, the numpy array decoders write, and its slot id (-1: not pooled, never released). A
        worker process's batch carries its shared tensor, sent by handle; a pinned buffer, the tensor the copy to the
        device starts from; otherwise the array itself, which HostBatch.tensors() makes the batch's own tensor in the
        training thread: its life (and its views', whose base it is) is then the caller's alone, as a worker
        process's batch arriving in the training process is (see `lend`)."""
        me = worker_id() if worker is None else worker
        if me is None and not self.shared:  # decoded in the training process (num_workers=0): worker 0's pool
            me = 0
        if me is None or not self.ring:
            return self._carried(self._new(), -1)
        flags, pool = self._flags[me], self.pools.setdefault(me, [])
        for slot, (carried, pixels) in enumerate(pool):
            if flags[slot] == 1:
                flags[slot] = 0
                return carried, pixels, me * self.ring + slot
        if len(pool) < self.ring:
            pool.append(self._carried(self._new(), 0)[:2])
            flags[len(pool) - 1] = 0
            return (*pool[-1], me * self.ring + len(pool) - 1)
        return self._carried(self._new(), -1)

    def _carried(self, buffer: torch.Tensor, slot: int):
        pixels = buffer.numpy()
        return (buffer if self.shared or self.pin else pixels), pixels, slot

    def release(self, slot: int) -> None:
        if slot >= 0:
            self._flat[slot] = 1

    def lend(self, images: torch.Tensor, slot: int) -> torch.Tensor:
        """The tensor to give the caller for `images` (the batch's tensor over the slot's memory): made from a numpy
        view of its own, and the slot is released when both that view and the tensor are freed. Every view of the
        tensor keeps one of them alive (a slice or a permute through `_base`, `.numpy()` and its slices through
        their base), so none can see the buffer rewritten. Not covered: a tensor moved into shared memory
        (share_memory_(), a torch.multiprocessing queue) is copied there and lets go of the view, while a numpy
        array taken from it before still reads the slot (the load guide says: take it after, or send a clone)."""
        if slot < 0:
            return images
        self.lent.add(slot)
        carrier = images.numpy()[:]
        given = torch.from_numpy(carrier)
        last = [True, False]  # popped by each finalizer: the second, whichever it is, gets True (list.pop is atomic)

        def gone():
            if last.pop():
                self._returned(slot)

        weakref.finalize(carrier, gone).atexit = False
        weakref.finalize(given, gone).atexit = False
        return given

    def _returned(self, slot: int) -> None:
        self.lent.discard(slot)
        self.release(slot)

    def release_all(self) -> None:
        """Every slot free but those the caller still holds (between epochs: batches abandoned in flight)."""
        flags = np.ones_like(self._flat)
        flags[list(self.lent)] = 0  # a copy: a finalizer may change `lent` meanwhile
        self._flat[:] = flags  # in one step: no moment where a slot the caller holds reads free

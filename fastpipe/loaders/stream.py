"""The planned sample stream, separate from what a backend does with a batch.

SampleStream is one DataLoader worker's share of an epoch (epoch.py says which samples, in which order, for which
rank and worker), read through ShardSet and turned into HostBatches by the backend's `prepare` (prepare.py).
StreamLoader is the base of the backends whose host batches come from it, in DataLoader worker processes or in
worker threads of the training process (threads.py).
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
import weakref
from functools import partial

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fastpipe.dataset.manifest import Manifest
from fastpipe.errors import FastpipeError, FastpipeWarning
from fastpipe.loaders import processes
from fastpipe.loaders.base import Loader
from fastpipe.loaders.batch import HostBatch
from fastpipe.loaders.config import LoaderConfig
from fastpipe.loaders.epoch import TrainOrder, batches_per_epoch, step_slice, val_batches
from fastpipe.loaders.prefetch import fetched_ahead
from fastpipe.loaders.shards import ShardSet
from fastpipe.loaders.threads import InHelper, LoaderThreads


def train_order(shards: ShardSet, cfg: LoaderConfig, manifest: Manifest) -> TrainOrder:
    if cfg.balance:
        return TrainOrder(shards.counts, cfg.seed, cfg.shuffle_buffer, sample_weights(shards, manifest.class_weights()))
    return TrainOrder(shards.counts, cfg.seed, cfg.shuffle_buffer)


def sample_weights(shards: ShardSet, class_weights) -> np.ndarray:
    """Each sample's weight for class-balanced sampling, from its label(s) read once, a shard at a time: the
    class weight, or for a label set its rarest label's (1 for an image with no label)."""
    w = torch.as_tensor(np.asarray(class_weights, dtype=np.float64))
    out = np.empty(shards.total, np.float64)
    for s in range(len(shards.paths)):
        ids = np.arange(int(shards.starts[s]), int(shards.starts[s + 1]))
        shards.fetch(ids, np.full(len(ids), s))  # remote data: the whole split comes into the cache
        y = torch.from_numpy(shards.labels(ids, np.full(len(ids), s)))
        if shards.multilabel:  # the largest weight among the present labels; 1 where none is present
            out[ids] = torch.where(y > 0, w, 0.0).amax(1).where(y.sum(1) > 0, 1.0).numpy()
        else:
            out[ids] = w[y].numpy()
    return out


class SampleStream(IterableDataset):
    """This worker's batches of the epoch, prepared; a FastpipeError ends the stream as a HostBatch carrying it."""

    def __init__(self, shards: ShardSet, cfg: LoaderConfig, prepare, order: TrainOrder | None, shared: bool = True):
        self.shards, self.cfg, self.prepare, self.order = shards, cfg, prepare, order
        self.epoch = torch.zeros(1, dtype=torch.int64)
        self.position = torch.zeros(1, dtype=torch.int64)
        if shared:  # worker processes: so that set_epoch and a loaded position reach persistent workers
            self.epoch.share_memory_()
            self.position.share_memory_()

    def plan(self, worker: int, workers: int):
        """(sample ids, their positions in the epoch's sequence) of each batch this worker makes, in order. The
        epoch's sequence is drawn here, when the plan is made (worker threads': in the training thread, before they
        start), not at its first batch."""
        cfg, epoch = self.cfg, int(self.epoch[0])
        if cfg.split == "val":
            return self._val_plan(worker, workers)
        sequence, position = self.order.sequence(epoch), int(self.position[0])
        steps = batches_per_epoch("train", len(sequence), cfg.batch_size, cfg.world_size, position)
        rank, world, size = cfg.rank, cfg.world_size, cfg.batch_size
        cuts = (step_slice(position, t, rank, world, size) for t in range(worker, steps, workers))
        return ((sequence[w], np.arange(w.start, w.stop)) for w in cuts)

    def _val_plan(self, worker: int, workers: int):
        cfg = self.cfg
        for b, pieces in enumerate(val_batches(self.shards.counts, cfg.rank, cfg.world_size, cfg.batch_size)):
            if b % workers == worker:
                ids = np.concatenate([np.arange(p.count) + self.shards.starts[p.shard] + p.start for p in pieces])
                yield ids, ids

    def __iter__(self):
        info = get_worker_info()
        return self.batches(*((info.id, info.num_workers) if info else (0, 1)))

    def batches(self, worker: int, workers: int):
        """The batches of worker `worker` of `workers` (a process or a thread), prepared, in order."""
        epoch = int(self.epoch[0])
        counters = self.shards.files.counters if self.shards.cache is not None else None  # a folder's: none
        try:
            for ids, positions in fetched_ahead(self.shards, self.plan(worker, workers)):
                batch = self.prepare(self.shards.read(ids), positions, epoch)
                if counters is not None:
                    batch.io = counters.take()
                yield batch
        except FastpipeError as e:  # named and explained: the main process raises it without a worker traceback
            yield HostBatch.failed(str(e))


class StreamLoader(Loader):
    """Host batches from SampleStream in DataLoader worker processes or worker threads (torch and nvjpeg backends):
    subclasses give the preparation (`make_prepare`) and the device step (`_to_device`)."""

    def __init__(self, manifest: Manifest, cfg: LoaderConfig):
        super().__init__(manifest, cfg)
        self.shards = ShardSet(manifest, self.cfg.split)
        order = train_order(self.shards, self.cfg, manifest) if self.cfg.split == "train" else None
        workers, in_threads = self._pick_workers()
        self._order = order
        self._observe = self.cfg.threads is None and in_threads is True and self._may_switch(workers) and \
            self.cfg.split == "train"  # a val loader's consumer is the evaluation, not the training step
        self._trial = None  # the loop's batches/s in threads, while processes are tried
        self._build(workers, in_threads)
        if self.num_workers > 0:
            atexit.register(processes.stop_workers, weakref.ref(self))

    def _build(self, workers: int, in_threads: bool | str) -> None:
        """The sample stream and what runs it: this process's threads, a DataLoader of worker processes, or one of a
        helper process running the threads."""
        self.in_threads, self.in_helper = in_threads is True, in_threads == "helper"
        if self.in_threads:  # nothing goes through /dev/shm: the asked prefetch, whatever its size
            self.num_workers, self.prefetch = workers, self.cfg.prefetch_factor
        else:
            self.num_workers, self.prefetch = self._fit_shared_memory(workers)
        procs = 0 if self.in_threads else 1 if self.in_helper else self.num_workers
        self.dataset = SampleStream(self.shards, self.cfg, self.make_prepare(), self._order, shared=procs > 0)
        self._threads = None  # this iteration's LoaderThreads
        given = InHelper(self.dataset, self.num_workers, self.prefetch) if self.in_helper else self.dataset
        queued = self.prefetch  # a helper's threads hold N x (prefetch + 1) batches ahead already
        self.dataloader = None if self.in_threads else DataLoader(
            given, batch_size=None, num_workers=procs, pin_memory=self.cfg.pin_memory,
            persistent_workers=procs > 0, prefetch_factor=queued if procs > 0 else None,
            multiprocessing_context=processes.worker_context() if procs > 0 else None,
            worker_init_fn=partial(processes.worker_init, main_pid=os.getpid()))

    def _switch_if_the_step_holds_the_gil(self) -> None:
        """The default's second look, after an epoch in threads: a training step whose own thread kept a core for
        most of it (its Python never pausing) leaves the loader's threads little of the GIL, and takes less of it
        than it needs itself. Where the loop also waited for batches, worker processes train faster from the next
        epoch (the same batches, bit for bit). Where it did not, that step may still be slowed (or not: a thread
        spinning in a device sync without the GIL looks as busy), so one epoch in processes decides: kept if the
        loop ran TRIAL_GAIN faster in them, else threads again."""
        from fastpipe.loaders.stats import WAIT_FREE
        from fastpipe.loaders.workers import STEP_PYTHON, TRIAL_GAIN

        last = self.previous
        share = last.step_cpu_share() if last is not None else None
        if self._trial is not None:  # the iteration in processes has run (to its end, or not: then it rates 0)
            self._observe, threads, procs = False, self._trial, last.loop_rate()
            if procs < threads * TRIAL_GAIN:
                self.close()
                self._build(self.num_workers, True)
            print(f"fastpipe: in worker processes the loop ran {procs:.1f} batches/s, in threads {threads:.1f}: "
                  f"{'threads' if procs < threads * TRIAL_GAIN else 'worker processes'} from epoch {self.epoch + 1} "
                  f"on", file=sys.stderr)
            return
        if share is None:
            return
        waited = last.wait_s / max(last.seconds, 1e-9)  # the loader held the loop back at all
        if share < STEP_PYTHON or not self._processes_fit(self.num_workers):
            self._observe = False
            return
        self._observe = waited < WAIT_FREE  # only a trial needs another look
        self._trial = last.loop_rate() if self._observe else None
        self.close()
        self._build(self.num_workers, False)
        what = (f"and the loop still waited for batches: worker processes from epoch {self.epoch + 1} on"
                if self._trial is None else f"(the loop did not wait): epoch {self.epoch + 1} in worker processes, "
                                            f"to compare with the threads")
        print(f"fastpipe: the training step kept its thread busy {share:.0%} of its time {what}, which share no GIL "
              f"with the step (threads=True keeps threads)", file=sys.stderr)

    def make_prepare(self):
        raise NotImplementedError

    def close(self) -> None:
        """End the workers, processes or threads, now (they start again on the next iteration). Also called when an
        epoch is abandoned by an exception: otherwise a traceback kept in a reference cycle (pytest, a notebook)
        keeps the workers alive until the garbage collector finds it, which then cannot stop them cleanly."""
        if self.in_threads:
            if self._threads is not None:
                self._threads.close()
            self._threads = None
            return
        it = getattr(self.dataloader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.dataloader._iterator = None

    def batch_bytes(self) -> int:
        """Bytes of one host batch (for fitting the workers' queues into shared memory)."""
        split = self.manifest.split(self.cfg.split)
        return self.cfg.batch_size * sum(s.bytes for s in split.shards) // max(split.samples, 1)

    def _pick_workers(self) -> tuple[int, bool]:
        """(worker count, whether the workers are threads)."""
        from fastpipe.loaders.workers import DEFAULT_THREADS_UP_TO, gil_enabled, heuristic_workers, tuned_workers

        cfg = self.cfg
        if cfg.num_workers == "probe":
            return tuned_workers(self.manifest, cfg, self.name)
        workers = heuristic_workers(cfg.world_size if self.device.type == "cuda" else 1) \
            if cfg.num_workers is None else cfg.num_workers
        if workers == 0 or cfg.threads is not None:
            return workers, (cfg.threads if cfg.threads == "helper" else bool(cfg.threads)) if workers > 0 else False
        return workers, self.threads_by_default() and (workers <= DEFAULT_THREADS_UP_TO or not gil_enabled()
                                                        or not self._processes_fit(workers))

    def _may_switch(self, workers: int) -> bool:
        from fastpipe.loaders.workers import DEFAULT_THREADS_UP_TO, gil_enabled

        return self.cfg.num_workers != "probe" and gil_enabled() and workers <= DEFAULT_THREADS_UP_TO

    def _processes_fit(self, workers: int) -> bool:
        """Whether `workers` processes' batches fit in /dev/shm with the asked prefetch."""
        from fastpipe.loaders.workers import fit_shared_memory, shm_free

        prefetch = self.cfg.prefetch_factor
        return fit_shared_memory(workers, self.batch_bytes(), prefetch, shm_free())[:2] == (workers, prefetch)

    def threads_by_default(self) -> bool:
        """Whether worker threads are faster than processes for this backend's host work: where it runs without
        the GIL (see the torch backend)."""
        return False

    def _fit_shared_memory(self, workers: int) -> tuple[int, int]:
        from fastpipe.loaders.workers import fit_shared_memory, shm_free

        workers, prefetch, note = fit_shared_memory(workers, self.batch_bytes(), self.cfg.prefetch_factor,
                                                    shm_free())
        if note:
            warnings.warn(note, FastpipeWarning, stacklevel=4)
        return workers, prefetch

    def describe(self) -> dict:
        return {**super().describe(), "num_workers": self.num_workers, "prefetch_factor": self.prefetch,
                "workers_are": "threads" if self.in_threads else "threads in a helper process" if self.in_helper
                else "processes"}

    def _host_batches(self):
        if self._observe:
            self._switch_if_the_step_holds_the_gil()
        self.dataset.epoch[0] = self.epoch
        self.dataset.position[0] = self.position
        if self.in_threads:
            self.close()  # an abandoned iteration's threads end before the next one's start
            self.shards.files.counters.take()  # the epoch's requests only, as worker processes count from zero
            self._threads = LoaderThreads(self.dataset, self.num_workers, self.prefetch)
            return iter(self._threads)
        it = processes.started_holding_sigterm(lambda: iter(self.dataloader))
        processes.dead_workers_at_the_next_batch()
        return processes.deaths_named(it) if self.num_workers else it

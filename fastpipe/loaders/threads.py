"""Worker threads: a loader's batches made by threads of the training process instead of worker processes.

The torch backend's decoders release the GIL for the work that matters (the crop decoder, simplejpeg and OpenCV),
so N threads of one process decode about as fast as N processes, without what processes cost: every batch handed
over through shared memory (/dev/shm, which a container may have little of) with pickled metadata and a receiving
thread, an interpreter per worker (memory, start-up, a cold first epoch).

The threads share each batch. The plan is SampleStream's whole epoch, batch after batch (the batches N worker
processes make between them, in the order the caller takes them); a batch is opened (its samples read, its buffer
and draws: `prepare.begin`) by one thread, and its samples are decoded in chunks (the batch split evenly over the
threads, at least CHUNK samples each) by whichever threads are free (`prepare.part`), straight into the batch's
buffer; the thread that finishes its last chunk ends it (`prepare.end`). So every batch is the process mode's, bit
for bit, and the threads never idle while the last batch of an epoch is made by one of them, or while the caller
waits for its first batch. A backend whose preparation does not split (nvjpeg's: headers only) makes each batch in
one chunk. At most N x (prefetch + 1) batches are opened beyond the last the caller took, as N worker processes hold
them; batch t takes its buffer from the pool of worker t % N, as worker process t % N would.

A FastpipeError ends the stream as a HostBatch carrying it, as in worker processes. Another exception in a thread
is raised in the training process as it is, with its traceback, where it takes that batch.

Stopping (the epoch's end, an exception or Ctrl-C in the training process, the iterator dropped, `close()`): the
threads are told to stop and waited for; each finishes at most the chunk it is decoding or the batch it is opening.
They block SIGINT and SIGTERM, so a signal sent to the process always wakes the training process's main thread,
where Python handles it.
"""

from __future__ import annotations

import copy
import itertools
import signal
import threading

from torch.utils.data import IterableDataset

from fastpipe.errors import FastpipeError
from fastpipe.loaders.batch import HostBatch
from fastpipe.loaders.prefetch import fetched_ahead

THREAD_NAME = "fastpipe-loader"
CHUNK = 8  # samples a thread decodes at a time at least (about 2 ms at 320 px): one lock round per chunk
# Ctrl-C can land inside Thread.start(), before or after the thread was created: how long close() waits to see it
# begin. Only a start that was interrupted before the thread existed waits this long.
BEGIN_BOUND_S = 2.0


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def _own_shards(stream):
    """The stream with its own maps of a store's shards, as a worker process has it: another thread's fetch may
    replace a shard's map (a cached file evicted and fetched again), and a batch must be read through the map its
    samples were made present in (ShardCache.ensure). A folder's maps never change: the copies share them."""
    mine = copy.copy(stream)
    mine.shards = copy.copy(stream.shards)  # ShardSet.__copy__; the node cache is shared (thread-safe)
    return mine


class _Batch:
    """One batch being made: its preparation state, its chunks, what is left of them, and the result."""

    __slots__ = ("chunks", "done", "failed_at", "given", "job", "left", "result")

    def __init__(self, job, n: int, split: bool, workers: int = 1):
        self.job, self.given, self.result, self.done = job, 0, None, False
        size = max(CHUNK, -(-n // workers))  # a batch split evenly over the threads: fewest chunks, each a lock round
        self.chunks = [(lo, min(lo + size, n)) for lo in range(0, n, size)] if split and n else [(0, n)]
        self.left = len(self.chunks)  # chunks not finished
        self.failed_at: int | None = None  # the first sample of the earliest chunk that failed

    @property
    def failed(self) -> bool:
        return self.failed_at is not None

    @classmethod
    def unopened(cls, result) -> _Batch:
        """A batch that failed before it had samples: nothing to decode, its result the failure."""
        b = cls(None, 0, False)
        b.chunks, b.left, b.done, b.result, b.failed_at = [], 0, True, result, -1
        return b


def _failure(e: BaseException):
    """What the caller gets for an error in a thread: a FastpipeError as a failed batch (its message, no worker
    traceback, as from worker processes), anything else raised as it is."""
    return HostBatch.failed(str(e)) if isinstance(e, FastpipeError) else _Raised(e)


class LoaderThreads:
    """One epoch's batches from `workers` threads sharing each batch; iterate once."""

    def __init__(self, stream, workers: int, prefetch: int):
        self.stream, self.workers = stream, workers
        self.prepare, self.epoch = stream.prepare, int(stream.epoch[0])
        self.split = hasattr(self.prepare, "part")
        self.ahead = workers * (max(prefetch, 1) + 1)  # as N worker processes: prefetch queued + one being made
        self._reader = _own_shards(stream)
        self._plan = fetched_ahead(self._reader.shards, self._reader.plan(0, 1))
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._made: dict[int, _Batch] = {}  # opened, not taken yet
        self._opened = self._taken = 0
        self._current: _Batch | None = None  # the batch whose chunks are being handed out
        self._opening = self._ended = False  # ended: no batch after the last opened
        self._threads = [threading.Thread(target=self._run, args=(w,), name=f"{THREAD_NAME}-{w}", daemon=True)
                         for w in range(workers)]
        self._began = [threading.Event() for _ in range(workers)]
        self._asked = 0  # threads whose start() was called

    def __iter__(self):
        try:
            for t in self._threads:
                self._asked += 1
                t.start()
            for t in itertools.count():
                with self._cond:
                    while not self._ready(t):
                        self._cond.wait()
                    if self._stop.is_set():  # closed (a new iteration began, or close()): nothing more from here
                        return
                    b = self._made.pop(t, None)
                    self._taken = t + 1
                    self._cond.notify_all()
                if b is None:
                    return
                result, b.result = b.result, None  # the caller's alone: its buffer returns when the caller drops it
                if isinstance(result, _Raised):
                    raise result.error
                yield result
                if b.failed:  # a FastpipeError ends the stream, as in worker processes
                    return
        finally:
            self.close()

    def _ready(self, t: int) -> bool:
        """Batch t is made, or there is none, or the threads were stopped."""
        if self._stop.is_set():
            return True
        b = self._made.get(t)
        return b.done if b is not None else self._ended and not self._opening

    def _run(self, w: int) -> None:
        self._began[w].set()
        if self._stop.is_set():  # closed while this thread was being started
            return
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        own = _own_shards(self.stream).shards  # to fetch a damaged sample again through
        while (task := self._claim()) is not None:
            self._work(*task, own)
            del task  # nothing of a batch is kept while this thread waits for the next chunk

    def _work(self, b: _Batch, chunk: tuple[int, int], own) -> None:
        lo, hi = chunk
        try:
            if not b.failed or lo < b.failed_at:  # the earliest failure is the batch's, as one process finds it
                if self.split:
                    self.prepare.part(b.job, lo, hi, own)
                else:
                    b.result = self.prepare(*b.job, self.epoch)
        except BaseException as e:
            self._fail(b, e, lo)
        self._finish(b)

    def _claim(self):
        """(batch, chunk) to decode next, opening the next batch when the current one is all handed out; None when
        there is nothing left or the threads are stopped."""
        while True:
            with self._cond:
                while True:
                    if self._stop.is_set():
                        return None
                    b = self._current
                    if b is not None and b.given < len(b.chunks):
                        b.given += 1
                        return b, b.chunks[b.given - 1]
                    if self._ended:
                        return None
                    if not self._opening and self._opened < self._taken + self.ahead:
                        break
                    self._cond.wait()
                self._opening, t = True, self._opened
            b = None
            try:
                b = self._open(t)
            except BaseException as e:  # _open takes its errors into the batch: this is the last resort
                b = _Batch.unopened(_Raised(e))
            finally:
                with self._cond:
                    self._opening = False
                    if b is None:
                        self._ended = True
                    else:
                        self._made[t], self._current, self._opened = b, b, t + 1
                        self._ended = self._ended or b.failed
                    self._cond.notify_all()

    def _open(self, t: int) -> _Batch | None:
        """Batch t read and begun (its buffer from the pool of worker t % N), or None after the plan's last."""
        try:
            item = next(self._plan, None)
            if item is None:
                return None
            ids, positions = item
            raw = self._reader.shards.read(ids)
            job = self.prepare.begin(raw, positions, self.epoch, t % self.workers) if self.split else (raw, positions)
            return _Batch(job, len(ids), self.split, self.workers)
        except BaseException as e:
            return _Batch.unopened(_failure(e))

    def _fail(self, b: _Batch, e: BaseException, at: int) -> None:
        """Chunk `at` of b failed: the batch's result is the failure of its earliest failed chunk."""
        result = _failure(e)
        with self._cond:
            if not b.failed or at < b.failed_at:
                b.failed_at, b.result = at, result
            self._ended = True  # nothing opened after a failed batch: the caller stops there

    def _finish(self, b: _Batch) -> None:
        """A chunk of b is done; after its last, the batch is ended (outside the lock) and handed over."""
        with self._cond:
            b.left -= 1
            if b.left:
                return
        try:
            if not b.failed:
                if self.split:
                    b.result = self.prepare.end(b.job)
                if self._reader.shards.cache is not None:  # a store's requests (a folder's are none)
                    b.result.io = self._reader.shards.files.counters.take()
        except BaseException as e:
            self._fail(b, e, b.chunks[-1][1])  # after every sample: no chunk of b had failed
        finally:
            with self._cond:
                b.done, b.job = True, None  # the job's buffer and samples live on in the result alone
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the threads and wait for them (each finishes the chunk it is decoding or the batch it is opening)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t, began in zip(self._threads[: self._asked], self._began):
            if t is not threading.current_thread() and began.wait(BEGIN_BOUND_S):
                t.join()
        if all(not t.is_alive() for t in self._threads):
            self._plan.close()  # a fetch thread of remote data ends with it


class InHelper(IterableDataset):
    """The worker threads in one helper process (DataLoader's only worker): the same batches, made by the same
    threads, handed to the training process through shared memory as a worker process's are, so that a training
    step's Python never waits for the loader's share of the GIL."""

    def __init__(self, stream, workers: int, prefetch: int):
        self.stream, self.workers, self.prefetch = stream, workers, prefetch

    def __iter__(self):
        yield from LoaderThreads(self.stream, self.workers, self.prefetch)


def running() -> list[threading.Thread]:
    """This process's loader threads that have not ended (for tests and doctor)."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME) and t.is_alive()]

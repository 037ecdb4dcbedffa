"""Worker threads: a loader's batches made by threads of the training process instead of worker processes.

The torch backend's decoders release the GIL for the work that matters (the crop decoder, simplejpeg and OpenCV),
so N threads of one process decode about as fast as N processes, without what processes cost: every batch handed
over through shared memory (/dev/shm, which a container may have little of) with pickled metadata and a receiving
thread, an interpreter per worker (memory, start-up, a cold first epoch).

The plan is SampleStream's, worker for worker: thread w makes the batches that worker process w would make (the
epoch's batch t by thread t % N), into its own pooled buffers, each read through its own maps of the shards (as a
process has them), and hands them over in the plan's order through a queue of `prefetch` batches. So the batches
are the process mode's, bit for bit, and a FastpipeError ends the stream as a HostBatch carrying it, as there.
Another exception in a thread is raised in the training process as it is, with its traceback.

Stopping (the epoch's end, an exception or Ctrl-C in the training process, the iterator dropped, `close()`): the
threads are told to stop, their queues are emptied so that none waits to put a batch, and they are waited for; each
finishes at most the batch it is making. They block SIGINT and SIGTERM, so a signal sent to the process always
wakes the training process's main thread, where Python handles it.
"""

from __future__ import annotations

import copy
import itertools
import queue
import signal
import threading
from contextlib import closing

from fastpipe.loaders.batch import set_worker_thread

THREAD_NAME = "fastpipe-loader"
_END = object()  # a thread's plan is done
# Ctrl-C can land inside Thread.start(), before or after the thread was created: how long close() waits to see it
# begin. Only a start that was interrupted before the thread existed waits this long.
BEGIN_BOUND_S = 2.0


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def _own_shards(stream):
    """The stream with its own maps of the shards, as a worker process has it: with data in object storage, another
    thread's fetch may replace a shard's map (a cached file evicted and fetched again), and a batch must be read
    through the map its samples were made present in (ShardCache.ensure)."""
    mine = copy.copy(stream)
    mine.shards = copy.copy(stream.shards)  # ShardSet's copy starts without maps; its cache is shared (thread-safe)
    return mine


class LoaderThreads:
    """One epoch's batches from `workers` threads, each `prefetch` batches ahead at most; iterate once."""

    def __init__(self, stream, workers: int, prefetch: int):
        self.stream, self.workers = stream, workers
        self._stop = threading.Event()
        self._queues = [queue.Queue(max(prefetch, 1)) for _ in range(workers)]
        self._threads = [threading.Thread(target=self._run, args=(w,), name=f"{THREAD_NAME}-{w}", daemon=True)
                         for w in range(workers)]
        self._began = [threading.Event() for _ in range(workers)]
        self._asked = 0  # threads whose start() was called

    def __iter__(self):
        try:
            for t in self._threads:
                self._asked += 1
                t.start()
            for b in itertools.count():
                item = self._queues[b % self.workers].get()
                if item is _END:  # thread b % N has no batch b: neither has any later one (the plan is b % N)
                    return
                if isinstance(item, _Raised):
                    raise item.error
                yield item
        finally:
            self.close()

    def _run(self, w: int) -> None:
        self._began[w].set()
        if self._stop.is_set():  # closed while this thread was being started
            return
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        set_worker_thread(w, self.workers)
        out = self._queues[w]
        try:
            with closing(_own_shards(self.stream).batches(w, self.workers)) as batches:
                for batch in batches:
                    out.put(batch)
                    if self._stop.is_set():
                        return
        except BaseException as e:  # raised where the training process takes this thread's next batch
            out.put(_Raised(e))
            return
        out.put(_END)

    def close(self) -> None:
        """Stop the threads and wait for them (each finishes the batch it is making). A thread puts at most one more
        batch after its queue was emptied here, and its queue has room for it, so none is left waiting."""
        self._stop.set()
        for q in self._queues:
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for t, began in zip(self._threads[: self._asked], self._began):
            if t is not threading.current_thread() and began.wait(BEGIN_BOUND_S):
                t.join()


def running() -> list[threading.Thread]:
    """This process's loader threads that have not ended (for tests and doctor)."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME) and t.is_alive()]

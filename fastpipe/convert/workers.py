"""The converter's worker processes: an ordered map over them that ends, with the files it was converting, when a
worker dies.

multiprocessing.Pool replaces a worker that dies (the out-of-memory killer on a huge photo, a crash inside an image
decoder, `kill -9`) and waits forever for the task it held: a conversion hung there, at 38 % of the bar, until
interrupted. concurrent.futures' pool instead fails every pending task (BrokenProcessPool); `imap` says so with the
files that were in flight, and the journal keeps every shard finished before, so the same command resumes.
"""

from __future__ import annotations

import collections
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from fastpipe.errors import FastpipeError
from fastpipe.util import pool_context, reuse_freed_memory

AHEAD = 2  # tasks queued per worker: one running, one ready, so that a worker never waits for the next


class WorkerDied(FastpipeError, RuntimeError):
    """A worker process ended without finishing its task."""


class Workers:
    """`count` processes, each set up by `initializer(*initargs)`; fork where safe (util.pool_context)."""

    def __init__(self, count: int, initializer, initargs: tuple):
        self.count = count
        self.executor = ProcessPoolExecutor(count, mp_context=pool_context(), initializer=_start,
                                            initargs=(initializer, initargs))
        self.executor.submit(int)  # the processes start now (while the main process hashes), not at the first image

    def imap(self, fn, items, chunksize: int = 1, pixels: list[int] | None = None, ahead: int = AHEAD):
        """fn(item) for each item, in order, `chunksize` items a task, `ahead` tasks queued per worker; WorkerDied if
        a worker process dies. `pixels` (each item's image size) is for pools that reserve memory per task
        (onray.py): processes on one machine share its memory."""
        items = list(items)
        chunks = iter([items[k : k + chunksize] for k in range(0, len(items), chunksize)])
        pending: collections.deque = collections.deque()

        def submit() -> None:
            chunk = next(chunks, None)
            if chunk is None:
                return
            try:
                pending.append((chunk, self.executor.submit(_each, fn, chunk)))
            except BrokenProcessPool as e:  # a worker died before this chunk could be queued
                raise WorkerDied(_died([c for c, _ in pending] + [chunk])) from e

        for _ in range(max(ahead, 1) * self.count):
            submit()
        while pending:
            future = pending[0][1]
            try:
                results = future.result()
            except BrokenProcessPool as e:
                raise WorkerDied(_died([c for c, _ in pending])) from e
            pending.popleft()
            submit()
            yield from results

    def status(self) -> str:
        """What a progress bar shows beside the count (a cluster's pool says more: onray.py)."""
        return ""

    def notes(self) -> list[str]:
        """What the summary says about where the work ran: nothing to add on one machine."""
        return []

    def terminate(self) -> None:
        """Stop at once: queued tasks dropped, the processes ended (Ctrl-C, an error in the main process)."""
        results = getattr(self.executor, "_result_queue", None)
        stop = getattr(self.executor, "terminate_workers", None)  # Python 3.14
        if stop is not None:
            stop()
        else:
            processes = list((getattr(self.executor, "_processes", None) or {}).values())  # shutdown forgets them
            self.executor.shutdown(wait=False, cancel_futures=True)
            for p in processes:
                p.terminate()
            for p in processes:
                p.join(5)
        # A worker ended while sending its result leaves half a message in the result pipe, and the pool's thread
        # waits for the rest for ever; the interpreter's exit waits for that thread: the process never ended. With
        # the workers gone, closing our end of the pipe too makes that read end (EOF).
        if results is not None:
            results._writer.close()


def _start(initializer, initargs: tuple) -> None:
    """Each worker process's setup: ours alone, so its allocator and signal handlers are ours to set."""
    reuse_freed_memory()  # 14 % of a photo's worker CPU went to page faults without it
    # Ctrl-C reaches the whole process group: the main process stops the pool and says what to do
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker must not keep a caller's handler: terminate()
    # ends workers with SIGTERM
    initializer(*initargs)


def _each(fn, chunk: list) -> list:
    return [fn(item) for item in chunk]


def _died(chunks: list[list]) -> str:
    """The message: the files in flight when the tasks are files (converting), else how many (previews)."""
    items = [x for c in chunks for x in c]
    files = [x for x in items if isinstance(x, str)]
    shown = ", ".join(files[:16]) + (f" and {len(files) - 16} more" if len(files) > 16 else "")
    what = f"while converting one of: {shown}" if files else f"with {len(items)} tasks in flight"
    return (f"a conversion worker process died (killed by the system, e.g. out of memory on a very large photo, or "
            f"crashed inside an image decoder) {what}. The shards finished before are kept: run the same command "
            f"again to resume; if it dies at the same place, convert with more memory or fewer --workers, or move "
            f"these files aside")


__all__ = ["WorkerDied", "Workers"]

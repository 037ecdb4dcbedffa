"""A data set in object storage fetched into the node's cache ahead of decoding, window by window, from a thread
of the worker that decodes it (worker threads, processes and the helper process alike)."""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastpipe.loaders.shards import ShardSet

FETCH_WINDOW = 4  # batches fetched together (more samples per request: coalescing, fewer round trips)
FETCH_AHEAD = 2  # windows fetched ahead of the one being decoded
MAX_WINDOW = 32  # batches: a window doubles, up to this, each time decoding had to wait for it
MAX_WINDOW_BYTES = 64 << 20  # and to no more bytes than this: a window's bytes are all in memory before written


def fetched_ahead(shards: ShardSet, plan):
    """The plan, with a data set in object storage fetched into the node's cache ahead of decoding, from a
    thread: requests are in flight while this worker decodes, so store latency hides behind decode time.

    The first window is one batch, so that decoding starts after one small fetch; then windows of FETCH_WINDOW
    batches, doubled each time decoding waited for one. On a store slower to answer than decoding is to use up a
    window (bench_remote at 100 ms), fixed windows left decoding waiting about a round trip per window; a larger
    one pays the round trip once for more samples, in as many requests at once. A folder's plan is itself."""
    return plan if shards.cache is None else _fetching(shards, plan)


def _fetching(shards: ShardSet, plan):
    batches, cut, size = list(plan), 0, 1
    if not batches:  # a worker with no batch this epoch (more workers than a small split has batches)
        return
    largest = _largest_window(shards, len(batches[0][0]))
    pool = ThreadPoolExecutor(1, thread_name_prefix="fastpipe-fetch")
    pending: collections.deque = collections.deque()

    def submit():
        nonlocal cut
        w = batches[cut : cut + size]
        cut += len(w)
        pending.append((pool.submit(shards.fetch, np.concatenate([ids for ids, _ in w]), remap=False), w))

    try:
        submit()
        size = FETCH_WINDOW
        first = True
        while pending:
            while cut < len(batches) and len(pending) <= FETCH_AHEAD:  # this one and FETCH_AHEAD after it
                submit()
            future, w = pending.popleft()
            if not future.done() and not first:
                size = min(2 * size, largest)
            first = False
            waited = time.perf_counter()
            future.result()
            shards.fetch_wait_s += time.perf_counter() - waited  # reading, as the next read counts it
            yield from w
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _largest_window(shards: ShardSet, batch: int) -> int:
    """MAX_WINDOW batches, or fewer: MAX_WINDOW_BYTES at most, and under a cache limit the windows ahead and the
    one being decoded take at most half of it, since their samples must stay cached until decoded. Never fewer
    than FETCH_WINDOW."""
    per_batch = max(1.0, batch * sum(shards.cache.sizes) / max(shards.total, 1))
    room = MAX_WINDOW_BYTES if not shards.cache.limit else min(MAX_WINDOW_BYTES,
                                                               shards.cache.limit / (2 * (FETCH_AHEAD + 1)))
    return max(FETCH_WINDOW, min(MAX_WINDOW, int(room / per_batch)))


__all__ = ["fetched_ahead"]

"""The converter's photo work as tasks on a Ray cluster (`fastpipe shard SRC OUT --ray`): with raycluster.py, the only
modules that import Ray (the `fastpipe[ray]` extra).

`RayWorkers` is a pool like workers.Workers: `imap(fn, items, chunksize)` gives fn(item) for each item, in order. A few
photos make one Ray task (`chunksize` at first, then about TASK_SECONDS of work, once results tell the photos' speed),
which reserves 1 CPU and memory for its largest photo (its pixels, from its header, read while hashing); tasks are
spread over the nodes, and run again by Ray when their worker process or node is lost (TASK_RETRIES). At most AHEAD
tasks per CPU of the cluster are in flight; their results (encoded JPEGs and statistics, about 1/50 of the photos'
bytes) come back to this process, which alone writes the shards, in plan order, as a local run does: the output is
the same bytes whichever node converted which photo, and a task run twice is written once. So that "the same bytes"
holds, every task reports the image libraries of its node, and a node whose versions differ from this machine's stops
the run.

A task fails for good in two ways. An exception while converting a photo (the store refused the node's credentials,
an image library raised) comes back as a value naming the photo, and stops the run with that name: Ray does not
retry it. A worker process or node that died on every try (a decoder that crashes on a photo, memory) is tried again
one photo per task, so that the run stops naming the photo that crashes, and the others are converted.

A small actor on this node (raycluster.Board) records which task runs on which node and which try of it each start was:
the progress bar's "nodes busy" and "retried". Its records are not waited for (see _task), so the record of a try whose
worker died at once may never arrive: a task's result also says which try it was, and the retries are counted per task
from both. Ctrl-C cancels the tasks in flight (their workers are ended); the board ends with this process however it
ends (raycluster.py, which also joins the cluster).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass

import PIL
import ray
from PIL import features
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fastpipe import __version__
from fastpipe.convert.raycluster import Board, connect, driver
from fastpipe.errors import ConfigError, DataError, FastpipeError
from fastpipe.util import reuse_freed_memory

TASK_RETRIES = 3  # Ray's tries after the first, for a task whose worker process or node was lost
AHEAD = 2  # tasks in flight per CPU of the cluster: one running, one ready
TASK_SECONDS = 1.0  # the work a task is given, once the photos' speed is known: Ray's cost per task (milliseconds) is
# then small against it, and a lost node still loses only seconds of work
MAX_ITEMS = 64  # per task, whatever their speed
TASK_MEMORY = 256 << 20  # bytes a task reserves besides its photos: the worker's Python, numpy, Pillow
BYTES_PER_PIXEL = 8  # a photo's decoded planes and the colour conversion's and the resize's copies of them
POLL_SECONDS = 1.0  # how often the progress bar asks the board (and every 10th time, the cluster's size)
CODECS = (f"fastpipe {__version__}, Pillow {PIL.__version__}, "
          f"libjpeg-turbo {features.version_feature('libjpeg_turbo') or 'none'}")


@dataclass(frozen=True)
class _Failed:
    """A task's answer when converting `item` raised (or, item None, setting up its worker did)."""

    item: str | None
    node: str
    message: str
    ours: bool  # a FastpipeError (a refused store, SRC missing on the node): its message says what to do


_READY: str | None = None  # the job this worker process was set up for


@ray.remote
def _task(key: int, board, job: str, initializer, initargs: tuple, fn, chunk: list):
    node, attempt = ray.get_runtime_context().get_node_id(), _attempt()
    with contextlib.suppress(Exception):  # the bar's bookkeeping: never a reason to fail the photos
        # not waited for: a task blocked in ray.get gives its CPU back, and Ray then starts a worker process for a
        # queued task, only to end it again (about a CPU second each time)
        board.started.remote(key, node, attempt)
    try:
        _set_up(job, initializer, initargs)
    except Exception as e:
        return _Failed(None, node, _describe(e), isinstance(e, FastpipeError))
    out, start = [], time.perf_counter()
    for item in chunk:
        try:
            out.append(fn(item))
        except Exception as e:
            return _Failed(item if isinstance(item, str) else None, node, _describe(e), isinstance(e, FastpipeError))
    board.finished.remote(key)
    return CODECS, node, out, time.perf_counter() - start, key, attempt or 0


def _attempt() -> int | None:
    """Which try of this task this is (0: the first), from Ray's worker; None where this Ray version does not say."""
    with contextlib.suppress(Exception):  # not a public call: the board counts starts without it
        return int(ray._private.worker.global_worker.core_worker.get_current_task_attempt_number())
    return None


def _set_up(job: str, initializer, initargs: tuple) -> None:
    global _READY
    if job != _READY:
        reuse_freed_memory()  # a Ray worker process runs one task at a time: ours to tune, as a local worker's
        initializer(*initargs)
        _READY = job


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, FastpipeError) else f"{type(e).__name__}: {e}"


class RayWorkers:
    """The pool: Ray tasks on the cluster at `address` ($RAY_ADDRESS when None; else a local cluster of `cpus`),
    which must answer as Ray within `timeout` seconds."""

    def __init__(self, address: str | None, cpus: int | None, initializer, initargs: tuple, timeout: float):
        self.where, self.connected = connect(address, cpus, timeout)
        self.job, self.keys = uuid.uuid4().hex, itertools.count()
        self.initializer, self.initargs = initializer, initargs
        here = ray.get_runtime_context().get_node_id()
        self.board = Board.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote(
            driver())
        self.inflight: set = set()
        self.tasks, self.nodes_used, self.retried, self.again = 0, set(), 0, {}
        self._status, self._polled, self._polls = "", 0.0, 0
        self._size()

    def _size(self) -> None:
        """The cluster's CPUs, its nodes and the most memory one of them has (nodes may come and go)."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.nodes = len(nodes)
        self.cpus = int(sum(n["Resources"].get("CPU", 0) for n in nodes))
        self.largest = max((n["Resources"].get("memory", 0) for n in nodes), default=0)

    def imap(self, fn, items, chunksize: int = 1, pixels: list[int] | None = None):
        """fn(item) for each item, in order; `pixels[i]`: what item i decodes (its task reserves memory for it).
        Tasks start at `chunksize` items and grow to about TASK_SECONDS of work as results tell the items' speed."""
        items = list(items)
        pixels = pixels or [0] * len(items)
        pending: collections.deque = collections.deque()
        sent, pace = 0, _Pace(chunksize)
        while True:
            while sent < len(items) and len(pending) < max(2, AHEAD * self.cpus):  # nodes may have joined
                n = pace.items(len(items) - sent, self.cpus)
                chunk, largest = items[sent : sent + n], max(pixels[sent : sent + n])
                pending.append((chunk, largest, self._submit(fn, chunk, largest)))
                sent += n
            if not pending:
                return
            chunk, largest, ref = pending.popleft()
            yield from self._result(fn, chunk, largest, ref, pace)

    def _submit(self, fn, chunk: list, largest: int, retries: int = TASK_RETRIES):
        need = TASK_MEMORY + largest * BYTES_PER_PIXEL
        need = min(need, self.largest) if self.largest else need  # what no node has can never be scheduled
        ref = _task.options(memory=int(need), max_retries=retries, scheduling_strategy="SPREAD").remote(
            next(self.keys), self.board, self.job, self.initializer, self.initargs, fn, chunk)
        self.inflight.add(ref)
        return ref

    def _result(self, fn, chunk: list, largest: int, ref, pace: _Pace | None = None) -> list:
        try:
            answer = _get(ref)
        except ray.exceptions.RayError as e:  # the worker process or node died on every try
            return self._one_by_one(fn, chunk, largest, e)
        finally:
            self.inflight.discard(ref)
        return self._checked(answer, pace)

    def _checked(self, answer, pace: _Pace | None = None) -> list:
        if isinstance(answer, _Failed):
            raise _failure(answer)
        codecs, node = answer[:2]  # first: another fastpipe version may answer in another shape
        if codecs != CODECS or len(answer) != 6:
            build = "" if len(answer) == 6 else " (another build)"
            raise ConfigError(f"Ray node {node} converts with {codecs}{build}, this machine with {CODECS}: the shards "
                              f"would depend on which machine converted which photo. Install the same fastpipe, "
                              f"Pillow and libjpeg-turbo on every node and here")
        _, _, out, seconds, key, attempt = answer
        if pace is not None:
            pace.took(len(out), seconds)
        self.again[key] = attempt
        self.tasks += 1
        self.nodes_used.add(node)
        return out

    def _one_by_one(self, fn, chunk: list, largest: int, error: BaseException) -> list:
        """Each photo of a task that failed for good again, alone in a task, so that the one to blame is named."""
        refs = [self._submit(fn, [item], largest, retries=1) for item in chunk]
        out = []
        for item, ref in zip(chunk, refs):
            try:
                out += self._checked(_get(ref))
            except ray.exceptions.RayError as e:
                raise WorkerLost(item, e) from None
            finally:
                self.inflight.discard(ref)
        return out

    def status(self) -> str:
        """For the progress bar: nodes busy of the cluster's, and the tasks started again after a loss."""
        if time.monotonic() - self._polled >= POLL_SECONDS:
            self._polled, self._polls = time.monotonic(), self._polls + 1
            with contextlib.suppress(ray.exceptions.RayError):
                retried, busy = ray.get(self.board.snapshot.remote(), timeout=5)
                self.retried = max(retried, sum(self.again.values()))  # each counts a part: the larger, while running
                if self._polls % 10 == 0:
                    self._size()
                self._status = f"{busy}/{self.nodes} nodes busy, {self.retried} retried"
        return self._status

    def notes(self) -> list[str]:
        self._polled = 0.0
        self.status()
        with contextlib.suppress(ray.exceptions.RayError):
            self.retried = _runs_again(ray.get(self.board.runs_again.remote(), timeout=30), self.again)
        return [f"converted on Ray ({self.where}): {self.tasks} tasks on {len(self.nodes_used)} of {self.nodes} "
                f"nodes, {self.retried} tasks run again after a lost worker or node"]

    def terminate(self) -> None:
        """Cancel every task in flight (Ctrl-C, an error), then leave the cluster (and stop it, if it was ours)."""
        with contextlib.suppress(Exception):  # best effort: Ctrl-C may have reached Ray's own processes too
            for ref in list(self.inflight):
                ray.cancel(ref, force=True)
            ray.kill(self.board)
        if self.connected:
            with contextlib.suppress(Exception):
                ray.shutdown()


def _runs_again(board: dict[int, int], results: dict[int, int]) -> int:
    """How many times tasks were run again, per task the larger of the board's record and the try its result named."""
    return sum(max(board.get(k, 0), results.get(k, 0)) for k in board.keys() | results.keys())


def _get(ref):
    """ray.get, back in Python every second: a wait inside Ray's client does not always run Python's signal
    handlers, so Ctrl-C (or SIGTERM) would wait for the task to end."""
    while True:
        try:
            return ray.get(ref, timeout=1.0)
        except ray.exceptions.GetTimeoutError:
            continue


class _Pace:
    """How many items the next task gets: `first` until a result tells their speed, then about TASK_SECONDS' worth;
    near the end, no more than an equal share of what is left per CPU, so that the last tasks end together rather
    than one CPU converting a whole task's photos while the others wait."""

    def __init__(self, first: int):
        self.first, self.done, self.seconds = first, 0, 0.0

    def took(self, items: int, seconds: float) -> None:
        self.done, self.seconds = self.done + items, self.seconds + seconds

    def items(self, left: int, cpus: int) -> int:
        size = self.first
        if self.done and self.seconds > 0:
            size = max(self.first, min(MAX_ITEMS, round(TASK_SECONDS * self.done / self.seconds)))
        return max(1, min(size, -(-left // max(1, cpus))))


class WorkerLost(DataError):
    """A photo whose conversion's worker process (or node) died on every try."""

    def __init__(self, item, error: BaseException):
        why = (str(error).strip().splitlines() or [""])[0][:300]
        super().__init__(f"{item}: the worker process converting it died each time it was tried ({type(error).__name__}"
                         f": {why}): a crash inside an image decoder, or out of memory on a very large photo. The "
                         f"shards finished before are kept: move the photo aside (or give the nodes more memory), "
                         f"then run the same command again to resume")


def _failure(failed: _Failed) -> DataError:
    where = f"on Ray node {failed.node[:12]}"
    if failed.item is None:
        return DataError(f"setting up a conversion worker {where} failed: {failed.message}")
    if failed.ours:
        return DataError(f"{failed.item} ({where}): {failed.message}")
    return DataError(f"{failed.item}: converting it raised {failed.message} ({where}), where a damaged photo is a "
                     f"rejection: move the photo aside and report it (an image library or fastpipe is at fault), then "
                     f"run the same command again to resume")


__all__ = ["RayWorkers", "WorkerLost"]

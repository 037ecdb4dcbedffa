"""`fastpipe.watch(loader)`: is the loader or the device holding your own training loop back?

    for x, y in (w := fastpipe.watch(loader, every=100)):
        ...                                  # your step: forward, backward, optimizer
    print(w)                                 # the verdict, where the loader's time goes, what to change

It sits where every step passes: the time the loop waits in `next()` (the hand-over), the time until it asks for
the next batch (the step), the device's time for the step on CUDA (events, read when they are done: never a
synchronisation), and memory at each step boundary. The verdict uses `fastpipe bench`'s thresholds on the share of
each step spent waiting; a fastpipe loader adds its stage timing (loader.stats.stages), and the advice follows the
stage that dominates. The first `warmup` steps (workers starting, caches filling, kernels being tuned) are reported
apart. Any iterable can be watched (a torch DataLoader, a webdataset pipeline): without stages, wait against step.
"""

from __future__ import annotations

import collections
import math
import sys
import time
import warnings

from fastpipe.bench import growth
from fastpipe.bench.growth import Growth, process_memory
from fastpipe.bench.watchreport import lines, summary
from fastpipe.errors import ConfigError, FastpipeWarning
from fastpipe.options import check_number

WARMUP = 20  # steps reported apart from the steady state
WRITE_EVERY = 50  # steps between a SummaryWriter's points when `every` is not given
class Watch:
    """Iterate it in place of the loader; `summary()` (a dict) and `str()` (a few lines) at any time."""

    def __init__(self, iterable, every: int | None = None, writer=None, warmup: int = WARMUP, log=None,
                 trace_memory: bool = False):
        if not hasattr(iterable, "__iter__"):
            raise ConfigError(f"watch({type(iterable).__name__}): give what a for loop takes (a fastpipe loader, a "
                              f"torch DataLoader, any iterable)")
        if every is not None:
            check_number("watch every", every, int, 1)
        check_number("watch warmup", warmup, int, 0)
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError(f"watch writer {type(writer).__name__}: give a torch.utils.tensorboard SummaryWriter "
                              f"(or anything with add_scalar(tag, value, step))")
        self.iterable, self.every, self.writer, self.warmup = iterable, every, writer, warmup
        self.trace_memory, self._sites = bool(trace_memory), None  # CUDA: live bytes per site when tracing began
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.steps = self.images = 0
        self.first = [0.0, 0.0, 0]  # warm-up: wait, step seconds, steps
        self.steady = [0.0, 0.0, 0]  # after it: wait, step seconds, steps
        self.window = [0.0, 0.0, 0]  # since the last line or point
        self.device_s, self.device_steps, self._events = 0.0, 0, []
        self.memory: Growth | None = None
        self._stages: dict[str, float] = {}  # finished iterations' loader stages
        self._stage_images, self._live = 0, []  # ... and the loader.stats of iterations under way
        self._memory_every = 1  # steps between memory samples (more when reading the count is slow)
        self._costs: collections.deque = collections.deque(maxlen=8)  # seconds of the last reads of the count

    # -- the loop ------------------------------------------------------------------------------------------------
    def __iter__(self):
        it, handed, mine = iter(self.iterable), None, None
        try:
            while True:
                asked = time.perf_counter()
                if handed is not None:
                    self._stepped(asked - handed)
                try:
                    batch = next(it)
                except StopIteration:
                    return
                handed = time.perf_counter()
                self._waited(handed - asked, batch)
                if mine is None:  # this iteration's loader.stats (a fastpipe loader makes it as the iteration begins)
                    mine = self._capture()
                yield batch
        finally:
            if self._events and not isinstance(self._events[-1], tuple):
                self._events.pop()  # a step left by a break or an error: never ended, never timed
            self._fold(mine)

    def _capture(self):
        stats = getattr(self.iterable, "stats", None)
        if not isinstance(getattr(stats, "stages", None), dict):
            return None
        self._live.append(stats)
        return stats

    def _waited(self, wait: float, batch) -> None:
        self.steps += 1
        if self.memory is None:
            self._start(batch)
        self.images += _count(batch)
        self._pending_wait = wait
        if self._cuda is not None:
            self._mark()

    def _stepped(self, step: float) -> None:
        wait, k = self._pending_wait, self.steps
        if self._cuda is not None:
            self._mark(end=True)
        if k <= self.warmup:
            self.first[0] += wait
            self.first[1] += step
            self.first[2] += 1
        else:
            self.steady[0] += wait
            self.steady[1] += step
            self.steady[2] += 1
            if k == self.warmup + 1 and self.trace_memory and self._cuda is not None:
                self._sites = growth.start_tracing(self._cuda)  # after warm-up: its allocations are not the leak
            found = self.memory.add(k, self._used()) if k % self._memory_every == 0 else None
            if found:
                self._where_it_grows(found)
                warnings.warn(found["text"], FastpipeWarning, stacklevel=3)
                self.log(f"fastpipe.watch: {found['text']}")
        self.window[0] += wait
        self.window[1] += step
        self.window[2] += 1
        self._report(k)

    def _where_it_grows(self, found: dict) -> None:
        """trace_memory on CUDA: the allocation sites whose live bytes grew since tracing began, then tracing ends
        (it costs on every allocation)."""
        if self._sites is None:
            return
        sites = growth.growing_sites(self._sites, growth.site_bytes(self._cuda))
        growth.stop_tracing(self._cuda)
        self._sites = None
        found["sites"] = [{"where": w, "bytes": b} for w, b in sites]
        if sites:
            found["text"] += "; the allocations that grew come from " + ", ".join(
                f"{w} (+{b / 2**20:,.0f} MB)" for w, b in sites)

    def __len__(self) -> int:
        return len(self.iterable)  # what the loop expects of the loader (progress bars, Lightning)

    def set_epoch(self, epoch: int) -> None:
        """The loader's set_epoch, for loops that call it on what they iterate."""
        self.iterable.set_epoch(epoch)

    def _start(self, batch) -> None:
        import torch

        device = _device(batch)
        if (device is None or device.type != "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())  # CPU batches the step moves to the GPU
        self._cuda = device if device is not None and device.type == "cuda" else None
        if self.trace_memory and self._cuda is None:
            warnings.warn("watch(trace_memory=True) names allocation sites on CUDA only (PyTorch's memory history); "
                          "here memory is watched without them", FastpipeWarning, stacklevel=4)
        if self._cuda is not None:
            cap, where = torch.cuda.get_device_properties(self._cuda).total_memory, f"allocated on {self._cuda}"
        else:
            import psutil

            cap, where = process_memory() + psutil.virtual_memory().available, "this process's live allocations"
        self.memory = Growth(cap, where)

    def _used(self) -> int:
        if self._cuda is not None:
            import torch

            return torch.cuda.memory_allocated(self._cuda)
        start = time.perf_counter()
        used = process_memory()
        self._costs.append(time.perf_counter() - start)
        cycle = (self.steady[0] + self.steady[1]) / max(self.steady[2], 1)
        if cycle > 0:  # glibc walks its free chunks, slow in a heap of many: at most 2 % of a step. The least of the
            # recent reads is the cost: one the scheduler preempted on a busy machine would stretch the gap for good
            self._memory_every = max(1, min(256, math.ceil(min(self._costs) / (0.02 * cycle))))
        return used

    def _mark(self, end: bool = False) -> None:
        """CUDA: an event at each end of the step, on the current stream; their time is read once both are done."""
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._cuda))
        if end and self._events:
            self._events[-1] = (self._events[-1], event)
        else:
            self._events.append(event)
        while self._events and isinstance(self._events[0], tuple) and self._events[0][1].query():
            a, b = self._events.pop(0)
            self.device_s += a.elapsed_time(b) / 1000
            self.device_steps += 1

    # -- reports ---------------------------------------------------------------------------------------------------
    def _report(self, k: int) -> None:
        every = self.every or (WRITE_EVERY if self.writer is not None else None)
        if every is None or k % every:
            return
        wait, step, n = self.window
        self.window = [0.0, 0.0, 0]
        share = wait / max(wait + step, 1e-12)
        used = self._used()
        if self.every:
            self.log(f"fastpipe.watch: step {k:,}: {1000 * wait / n:.1f} ms waiting for data, {1000 * step / n:.1f} ms "
                     f"step ({share:.0%} waiting) over the last {n}; memory {used / 2**20:,.0f} MB")
        if self.writer is not None:
            points = {"wait_share": share, "wait_ms": 1000 * wait / n, "step_ms": 1000 * step / n,
                      "memory_MB": used / 2**20, **{f"stage_ms_per_image/{s}": 1000 * v
                                                    for s, v in (self.stages() or {}).items()}}
            try:
                for tag, value in points.items():
                    self.writer.add_scalar(f"fastpipe/{tag}", value, k)
            except Exception as e:  # a writer's own failure (a full disk, a closed writer) must not stop training
                warnings.warn(f"watch: the SummaryWriter failed ({type(e).__name__}: {str(e)[:150]}); watching goes "
                              f"on without it", FastpipeWarning, stacklevel=4)
                self.writer = None

    def _fold(self, s) -> None:
        """An iteration ended: its loader's stages join the watch's (the next iteration's stats start from zero)."""
        if s is None or s not in self._live:
            return
        self._live.remove(s)
        for k, v in s.stages.items():
            self._stages[k] = self._stages.get(k, 0.0) + v
        self._stage_images += s.samples + s.skipped

    def stages(self) -> dict[str, float] | None:
        """Seconds per image of each stage of a fastpipe loader, largest first; None for other iterables."""
        if not self._live and not self._stages and not self._stage_images:
            return None
        totals, images = dict(self._stages), self._stage_images
        for s in self._live:
            for k, v in s.stages.items():
                totals[k] = totals.get(k, 0.0) + v
            images += s.samples + s.skipped
        return dict(sorted(((k, v / max(images, 1)) for k, v in totals.items()), key=lambda kv: -kv[1]))

    def summary(self) -> dict:
        return summary(self)

    def __str__(self) -> str:
        return "\n".join(lines(self.summary()))

    _cuda = None
    _pending_wait = 0.0


def _count(batch) -> int:
    """Samples in a batch: the length of its first tensor or array (searched through tuples, lists and dicts), else
    of the list it is, else 1."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if hasattr(item, "shape") and len(getattr(item, "shape", ())) > 0:
            return int(item.shape[0])
        if isinstance(item, dict):
            stack += list(item.values())[:16]
        elif isinstance(item, (tuple, list)):
            stack += list(item[:16])  # a batch's parts come first; a list of file names is not searched through
    return len(batch) if isinstance(batch, list) else 1


def _device(batch):
    """The device of the first tensor in a batch (a tuple, list or dict of them), or None."""
    import torch

    items = list(batch.values()) if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    return next((t.device for t in items if isinstance(t, torch.Tensor)), None)


def watch(iterable, every: int | None = None, writer=None, warmup: int = WARMUP, log=None,
          trace_memory: bool = False) -> Watch:
    """Watch the loop around `iterable`; see the module's documentation."""
    return Watch(iterable, every, writer, warmup, log, trace_memory)


__all__ = ["Watch", "watch"]

"""What a loader measures of each epoch (`loader.stats`), the stages its time is split into, and the verdict a
training loop's wait for data gives (the thresholds `fastpipe bench` and `fastpipe.watch` use too)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

WAIT_BOUND = 0.5  # half of every step spent waiting for data: the loader holds training back
WAIT_FREE = 0.1  # under a tenth of each step waiting: the loader is not what holds training back
BUSY_SHARE = 0.2  # other processes took a fifth of the machine's CPU: the figures are not this setup's speed


@dataclass
class LoaderStats:
    epoch: int = 0
    batches: int = 0
    samples: int = 0
    skipped: int = 0  # samples that failed to decode (replaced in train, left out in val)
    wait_s: float = 0.0  # time the consumer spent blocked waiting for the next batch
    seconds: float = 0.0  # wall time of the epoch's iteration
    skipped_keys: list[str] = field(default_factory=list)  # the first few, with the reason
    # A data set in object storage: what this epoch fetched into the node's cache, and the retries it took
    requests: int = 0
    fetched_bytes: int = 0
    retries: int = 0
    # Seconds per stage, summed over the batches and the workers that made them (STAGES says what each is)
    stages: dict[str, float] = field(default_factory=dict)
    # The consumer's steps (from handing a batch over to the next request): their wall time less the time the thread
    # stood ready for a core (other work's), and the time it ran. Their ratio: how much of its step the training
    # loop's own thread keeps a core, mostly holding the GIL (workers.STEP_PYTHON: threads or processes). Timed
    # only while the default worker mode looks at the step (a train loader's epochs in threads, until it decides).
    step_s: float = 0.0
    step_cpu_s: float = 0.0
    half_s: float = 0.0  # when the epoch's middle batch came: the second half is the loop's warm rate
    half_batches: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def loop_rate(self) -> float:
        """The loop's batches/s over the epoch's second half (the workers' start, the first reads, a compiled
        model's first steps left out); 0 before it got there."""
        done = self.batches - self.half_batches
        return done / max(self.seconds - self.half_s, 1e-9) if self.half_batches and done > 0 else 0.0

    def step_cpu_share(self) -> float | None:
        """The share of the consumer's steps its thread ran (None before 0.05 s of steps)."""
        return self.step_cpu_s / self.step_s if self.step_s >= 0.05 else None

    def per_image(self) -> dict[str, float]:
        """Seconds per image of each stage, largest first."""
        n = max(self.samples + self.skipped, 1)
        return dict(sorted(((k, v / n) for k, v in self.stages.items()), key=lambda kv: -kv[1]))


# What each stage of loader.stats.stages times. Workers' stages are summed over the workers (on N workers they add up
# to about N times the wall time when all are busy); "device" is the training process's own.
STAGES = {
    "read": "finding the batch's samples in the shards, reading their labels and fetching what is not in the node "
            "cache yet (a local shard's bytes are paged in by the decoder, counted under decode)",
    "decode": "decoding each JPEG with its crop, resize and flip (one call in fastpipe's decoders)",
    "headers": "reading each JPEG's header and drawing its crop (nvjpeg: the decoding itself runs on the device)",
    "assemble": "finishing the batch: replacing samples that failed, handing its buffer over",
    "device": "in the training process: the copy to the device and the device step (normalisation, device "
              "augmentation, mixing) as the host sees it; on CUDA the device's own time runs on asynchronously",
}


WORKER_STAGES = ("read", "decode", "headers", "assemble")  # made in the loader's workers, side by side


def wall_per_image(per_image: dict[str, float], workers: int) -> dict[str, float]:
    """Each stage's share of the loader's wall time per image: the workers' stages spread over the workers (they run
    side by side), the training process's own ("device") as it is. What to compare to find the stage that holds
    the loader back."""
    n = max(workers or 0, 1)
    return {k: v / n if k in WORKER_STAGES else v for k, v in per_image.items()}


def leading_stage(per_image: dict[str, float], workers: int) -> str | None:
    wall = wall_per_image(per_image, workers)
    return max(wall, key=wall.get) if wall else None


def wait_verdict(wait_share: float) -> str:
    """loader-bound, balanced or device-bound, from the share of each step spent waiting for data."""
    return "loader-bound" if wait_share >= WAIT_BOUND else "device-bound" if wait_share < WAIT_FREE else "balanced"


class OthersClock:
    """The share of the machine's CPU that other processes took since it started (the machine's busy time less this
    process's and its children's): what tells a figure disturbed by other work from one of this setup."""

    def __init__(self):
        self._start = (time.perf_counter(), _busy_seconds(), _own_seconds())

    def share(self) -> float:
        import psutil

        wall, busy, own = (b - a for a, b in zip(self._start, (time.perf_counter(), _busy_seconds(), _own_seconds())))
        return max(0.0, busy - own) / max(wall * (psutil.cpu_count() or 1), 1e-9)


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_seconds() -> float:
    """CPU seconds of this process and its live children (loader workers): ours, not other work's."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:4])  # with children that ended (reaped): theirs too
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def thread_clock() -> tuple[float, float]:
    """(seconds this thread ran, seconds it stood ready for a core) from Linux's schedstat; elsewhere its CPU time and
    nothing (a busy machine's waits then count as the step's own)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, ready = f.read(64).split()[:2]
        return int(ran) / 1e9, int(ready) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0

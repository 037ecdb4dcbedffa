"""The epoch rule: which samples an epoch visits, in which order, and which rank and worker reads each of them.

This is the one place that defines it (backends and tests import it).

- train, the order: the epoch's sample sequence is a function of (seed, epoch, data set) only, never of the world
  size or the worker count. The shards are put in a seeded order and grouped into blocks of consecutive shards (at
  least `block` samples and two shards per block, where there are); the samples of each block are permuted. So a
  batch mixes samples of many shards and classes, while reading stays within a few shards at a time. With
  balance, each sample appears floor(w) + Bernoulli(frac(w)) times (w: its class weight, drawn per epoch and
  sample) before the block is permuted; the sequence is then cut or extended (a second lap) to N samples.
- train, the split: global steps consume the sequence in order, `world x batch` samples per step; rank r takes
  the r-th `batch` of each step, and the rank's step t is made by worker t % workers (DataLoader's reading order).
  Every rank yields the same number of batches, `(N - position) // (world x batch)` (drop_last: a tiny last batch
  makes BatchNorm statistics jump); the remainder, fewer than world x batch samples, is left out of that epoch.
- resuming: `position` counts the samples the steps so far consumed. Because the sequence does not depend on the
  world size, a run stopped at any step can go on with other ranks, workers or even batch size: the rest of the
  sequence is read once, none twice. What is left out at the end differs (the remainder of the new step size).
- val: the ranks split the samples in manifest order into contiguous near-equal parts, so that together they see
  every sample exactly once; each rank yields `ceil(ceil(N / world) / batch)` batches, its part cut into that many
  near-equal batches (at most batch each). Batch b of a rank goes to worker b % num_workers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from fastpipe.errors import ConfigError


@dataclass(frozen=True)
class Piece:
    """`count` consecutive samples of shard `shard` starting at sample `start`."""

    shard: int
    start: int
    count: int


def batches_per_epoch(split: str, samples: int, batch_size: int, world_size: int, position: int = 0) -> int:
    """Batches each rank yields in an epoch, or in what is left of it from `position` (train)."""
    if split == "train":
        n = (samples - position) // (world_size * batch_size)
        if n == 0 and position == 0:
            raise ConfigError(f"{samples} train samples are fewer than world_size x batch_size = "
                             f"{world_size} x {batch_size}: lower the batch size")
        return max(n, 0)
    return math.ceil(math.ceil(samples / world_size) / batch_size)


def worker_batches(batches: int, worker: int, workers: int) -> int:
    """Batches that worker `worker` produces when batch b goes to worker b % workers."""
    return len(range(worker, batches, workers))


def shard_order(num_shards: int, seed: int, epoch: int, lap: int = 0) -> list[int]:
    return np.random.default_rng([seed, epoch, lap, 7]).permutation(num_shards).tolist()


def blocks(counts: list[int], order: list[int], block: int) -> list[list[int]]:
    """Consecutive shards of `order`, grouped until each group holds `block` samples and two shards."""
    out, cur, n = [], [], 0
    for s in order:
        cur.append(s)
        n += counts[s]
        if n >= block and len(cur) >= 2:
            out.append(cur)
            cur, n = [], 0
    if cur:
        if out and n < block:
            out[-1] += cur  # a short tail joins the last block rather than being mixed on its own
        else:
            out.append(cur)
    return out


class TrainOrder:
    """The epoch's sample sequence (global sample ids: positions in the shards concatenated in manifest order)."""

    def __init__(self, counts: list[int], seed: int, block: int, sample_weights=None):
        self.counts, self.seed, self.block = list(counts), seed, max(1, block)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.total = int(self.starts[-1])
        # Balance: each sample's weight (from its class weight; read once at construction).
        self.sample_weights = None if sample_weights is None else np.asarray(sample_weights, dtype=np.float64)

    def _lap(self, epoch: int, lap: int) -> np.ndarray:
        parts = []
        for b, group in enumerate(blocks(self.counts, shard_order(len(self.counts), self.seed, epoch, lap),
                                         self.block)):
            ids = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in group])
            if self.sample_weights is not None:
                w = self.sample_weights[ids]
                u = np.random.default_rng([self.seed, epoch, lap, b, 11]).random(len(ids))
                ids = np.repeat(ids, (np.floor(w) + (u < w - np.floor(w))).astype(np.int64))
            parts.append(ids[np.random.default_rng([self.seed, epoch, lap, b, 13]).permutation(len(ids))])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def sequence(self, epoch: int) -> np.ndarray:
        """N global sample ids in the order the epoch visits them."""
        laps = [self._lap(epoch, 0)]
        while sum(map(len, laps)) < self.total and len(laps) < 100:  # balance drew fewer than N: a second lap
            laps.append(self._lap(epoch, len(laps)))
        return np.concatenate(laps)[: self.total]


def step_slice(position: int, step: int, rank: int, world: int, batch: int) -> slice:
    """The part of the sequence rank `rank` consumes at its `step`-th batch after `position`."""
    start = position + (step * world + rank) * batch
    return slice(start, start + batch)


def val_batches(counts: list[int], rank: int, world: int, batch_size: int) -> list[list[Piece]]:
    """This rank's validation batches, in order, each as pieces of the shards in manifest order."""
    total = sum(counts)
    lo, hi = total * rank // world, total * (rank + 1) // world
    n_batches = batches_per_epoch("val", total, batch_size, world)
    bounds = np.linspace(lo, hi, n_batches + 1).round().astype(int)
    return [_cut(counts, int(a), int(b - a)) for a, b in itertools.pairwise(bounds)]


def _cut(counts: list[int], start: int, length: int) -> list[Piece]:
    """Pieces covering `length` samples from position `start` of the shards concatenated in manifest order."""
    pieces, pos = [], 0
    for shard, n in enumerate(counts):
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            pieces.append(Piece(shard, lo - pos, hi - lo))
        pos += n
        if pos >= start + length:
            break
    return pieces

"""The epoch rule: how many batches each rank yields, and which samples each rank and worker reads.

This is the one place that defines it (backends and tests import it):

- train: every rank yields `N // (world_size * batch_size)` full batches (drop_last; a tiny last batch makes
  BatchNorm statistics jump). The epoch's shard order is a seeded permutation; the concatenated sample
  sequence is cut into one contiguous segment per (rank, worker) slot, each exactly as long as that slot's
  batches need. So every rank yields the same count whatever the shard count versus ranks x workers (no
  webdataset-style hang on uneven shards), slots never share a sample, and the few samples left over
  (fewer than world_size * batch_size) are a different tail each epoch.
- val: the ranks split the samples in order into contiguous near-equal parts, so that together they see
  every sample exactly once; each rank yields `ceil(ceil(N / world_size) / batch_size)` batches, its part cut
  into that many near-equal batches (at most batch_size each). Batch b of a rank goes to worker
  b % num_workers, which is the order DataLoader reads workers in, so batches arrive in order.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Piece:
    """`count` consecutive samples of shard `shard` starting at sample `start`."""

    shard: int
    start: int
    count: int


def batches_per_epoch(split: str, samples: int, batch_size: int, world_size: int) -> int:
    if split == "train":
        n = samples // (world_size * batch_size)
        if n == 0:
            raise ValueError(f"{samples} train samples are fewer than world_size x batch_size = "
                             f"{world_size} x {batch_size}: lower the batch size")
        return n
    return math.ceil(math.ceil(samples / world_size) / batch_size)


def worker_batches(batches: int, worker: int, workers: int) -> int:
    """Batches that worker `worker` produces when batch b goes to worker b % workers."""
    return len(range(worker, batches, workers))


def _cut(order: list[int], counts: list[int], start: int, length: int) -> list[Piece]:
    """Pieces covering `length` samples from position `start` of the shards concatenated in `order`."""
    pieces, pos = [], 0
    for shard in order:
        n = counts[shard]
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            pieces.append(Piece(shard, lo - pos, hi - lo))
        pos += n
        if pos >= start + length:
            break
    return pieces


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    return np.random.default_rng([seed, epoch, 7]).permutation(num_shards).tolist()


def train_segment(counts: list[int], seed: int, epoch: int, rank: int, world: int, worker: int, workers: int,
                  batch_size: int) -> list[Piece]:
    """The samples slot (rank, worker) reads this epoch: exactly its batches x batch_size of them."""
    per_rank = batches_per_epoch("train", sum(counts), batch_size, world)
    needs = [worker_batches(per_rank, w, workers) * batch_size for w in range(workers)]
    start = rank * per_rank * batch_size + sum(needs[:worker])
    return _cut(shard_order(len(counts), seed, epoch), counts, start, needs[worker])


def val_batches(counts: list[int], rank: int, world: int, batch_size: int) -> list[list[Piece]]:
    """This rank's validation batches, in order, each as pieces of the shards in manifest order."""
    total = sum(counts)
    lo, hi = total * rank // world, total * (rank + 1) // world
    n_batches = batches_per_epoch("val", total, batch_size, world)
    bounds = np.linspace(lo, hi, n_batches + 1).round().astype(int)
    order = list(range(len(counts)))
    return [_cut(order, counts, int(a), int(b - a)) for a, b in itertools.pairwise(bounds)]

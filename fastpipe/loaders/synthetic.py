"""synthetic backend: one batch made once on the device and yielded len(loader) times.

The "infinitely fast loader": what the device alone can consume, the ceiling the benchmark compares with. It goes
through the same iteration as every backend (stats, batch count, state), only its device step is free.
"""

from __future__ import annotations

import torch

from fastpipe.loaders.base import Loader
from fastpipe.loaders.batch import HostBatch


class SyntheticLoader(Loader):
    name = "synthetic"
    unsupported = ("balance", "with_keys", "cpu_decoder")

    def __init__(self, manifest, cfg):
        super().__init__(manifest, cfg)
        g = torch.Generator().manual_seed(self.cfg.seed)
        n, s = self.cfg.batch_size, self.cfg.image_size
        images = torch.randint(0, 256, (n, s, s, 3), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, manifest.num_classes, (n,), generator=g)
        self._batch = (self.step.images(images), self.step.labels(labels))
        self._host = HostBatch(labels, torch.zeros(n, dtype=torch.int64))

    def _host_batches(self):
        return (self._host for _ in range(self._expected()))

    def _to_device(self, batch: HostBatch):
        return self._batch

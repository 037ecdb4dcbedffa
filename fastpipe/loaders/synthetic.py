"""synthetic backend: one batch made once on the device and yielded len(loader) times.

The "infinitely fast loader": what the device alone can consume, the ceiling the benchmark compares with.
"""

from __future__ import annotations

import torch

from fastpipe.loaders.base import Loader


class SyntheticLoader(Loader):
    name = "synthetic"

    def __init__(self, manifest, cfg):
        super().__init__(manifest, cfg)
        g = torch.Generator().manual_seed(self.cfg.seed)
        n, s = self.cfg.batch_size, self.cfg.image_size
        images = torch.randint(0, 256, (n, s, s, 3), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, manifest.num_classes, (n,), generator=g)
        self._batch = (self.step.images(images), self.step.labels(labels))

    def _host_batches(self):
        raise AssertionError("synthetic batches never leave the device")

    def __iter__(self):
        from fastpipe.loaders.base import LoaderStats

        self.stats = LoaderStats(epoch=self.epoch, batches=self.batches, samples=self.batches * self.cfg.batch_size)
        x, y = self._batch
        for _ in range(self.batches):
            yield x, y

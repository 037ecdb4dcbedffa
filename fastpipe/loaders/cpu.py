"""torch backend: DataLoader workers decode and augment on the CPU (the crop decoder or simplejpeg, + OpenCV on
uint8: cpu_ops.py) straight into shared-memory batch buffers that are recycled once the main process has copied
them out."""

from __future__ import annotations

from fastpipe.loaders import cpu_ops
from fastpipe.loaders.batch import BufferPool, HostBatch
from fastpipe.loaders.prepare import CpuDecode
from fastpipe.loaders.stream import StreamLoader


class TorchLoader(StreamLoader):
    name = "torch"

    def make_prepare(self):
        # uint8 output on the CPU hands the workers' shared buffer itself to the caller: it is lent, and goes back
        # to the pool when the caller has dropped every view of it (BufferPool.lend). Otherwise it is released as
        # soon as the batch has been copied out (float, or a device copy).
        self.hands_out_buffer = self.device.type == "cpu" and not self.cfg.normalize
        self.buffers = BufferPool(self.num_workers, self.prefetch + 2, self.cfg.batch_size, self.cfg.image_size)
        return CpuDecode(self.cfg, self.num_classes, self.manifest.multilabel, self.buffers)

    def describe(self) -> dict:
        return {**super().describe(), "decoder": cpu_ops.active(self.cfg.cpu_decoder)}

    def batch_bytes(self) -> int:
        return self.cfg.batch_size * self.cfg.image_size**2 * 3

    def _host_batches(self):
        # Idle workers between epochs: nothing is being written, and iter() drops the batches an epoch abandoned
        # half-way left in flight, so every pooled buffer the caller does not hold is free again.
        self.buffers.release_all()
        return super()._host_batches()

    def _release(self, batch: HostBatch) -> None:
        if self.hands_out_buffer:
            self.buffers.lend(batch.images, batch.slot)
        else:
            self.buffers.release(batch.slot)

"""torch backend: DataLoader workers decode and augment on the CPU (simplejpeg + OpenCV on uint8, cpu_ops.py)
straight into shared-memory batch buffers that are recycled once the main process has copied them out."""

from __future__ import annotations

from fastpipe.loaders.batch import BufferPool, HostBatch
from fastpipe.loaders.prepare import CpuDecode
from fastpipe.loaders.stream import StreamLoader


class TorchLoader(StreamLoader):
    name = "torch"

    def make_prepare(self):
        # Buffers are recycled when every batch is copied out before the caller sees it (see BufferPool), or when
        # the caller promises to be done with a batch when it asks for the next (reuse_output).
        self.hands_out_buffer = self.device.type == "cpu" and not self.cfg.normalize
        self.recycle = not self.hands_out_buffer or self.cfg.reuse_output
        self._held = -1  # the slot of the buffer the caller holds (reuse_output)
        self.buffers = BufferPool(self.num_workers, self.prefetch + 2 if self.recycle else 0, self.cfg.batch_size,
                                  self.cfg.image_size)
        return CpuDecode(self.cfg, self.num_classes, self.manifest.multilabel, self.buffers)

    def batch_bytes(self) -> int:
        return self.cfg.batch_size * self.cfg.image_size**2 * 3

    def _host_batches(self):
        if self.recycle:
            # Idle workers between epochs: nothing is being written, and iter() drops the batches an epoch
            # abandoned half-way left in flight, so every pooled buffer is free again.
            self.buffers.release_all()
            self._held = -1
        return super()._host_batches()

    def _release(self, batch: HostBatch) -> None:
        if not self.recycle:
            return
        if self.hands_out_buffer:  # reuse_output: the previous batch is done now that the next is asked for
            self.buffers.release(self._held)
            self._held = batch.slot
        else:
            self.buffers.release(batch.slot)  # the output is new memory (float, or a device copy)

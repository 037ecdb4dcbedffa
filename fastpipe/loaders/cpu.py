"""torch backend: loader workers decode and augment on the CPU (the crop decoder or simplejpeg, + OpenCV on uint8:
cpu_ops.py) straight into pooled batch buffers that are recycled once the training step has copied them out. The
workers are threads of the training process where the decoder releases the GIL (threads.py), else DataLoader
worker processes, whose buffers are in shared memory."""

from __future__ import annotations

from fastpipe.dataset import imageguard
from fastpipe.loaders import cpu_ops
from fastpipe.loaders.batch import BufferPool, HostBatch
from fastpipe.loaders.prepare import CpuDecode
from fastpipe.loaders.stream import StreamLoader
from fastpipe.loaders.workers import gil_enabled


def releases_gil(decoder: str) -> bool:
    """Whether this decoder setting decodes without holding the GIL: the crop decoder, simplejpeg and OpenCV do
    (the Python left is a few µs a sample); the Pillow path holds it for much of its work."""
    return not gil_enabled() or (decoder != "pillow" and cpu_ops.cv2 is not None)


class TorchLoader(StreamLoader):
    name = "torch"

    def make_prepare(self):
        # uint8 output on the CPU hands the workers' buffer itself to the caller: it is lent, and goes back to the
        # pool when the caller has dropped every view of it (BufferPool.lend). Otherwise it is released as soon as
        # the batch has been copied out (float, or a device copy: for a pinned buffer, once that copy has run).
        self.hands_out_buffer = self.device.type == "cpu" and not self.cfg.normalize
        self._copying: list = []  # (CUDA event, slot) of pinned buffers whose copy to the device was queued
        self.buffers = BufferPool(self.num_workers, self.prefetch + 2, self.cfg.batch_size, self.cfg.image_size,
                                  shared=not self.in_threads and self.num_workers > 0,
                                  pin=self.in_threads and bool(self.cfg.pin_memory) and self.device.type == "cuda")
        return CpuDecode(self.cfg, self.num_classes, self.manifest.multilabel, self.buffers,
                         imageguard.data_set_limit(self.manifest.settings))

    def threads_by_default(self) -> bool:
        return releases_gil(self.cfg.cpu_decoder)

    def describe(self) -> dict:
        return {**super().describe(), "decoder": cpu_ops.active(self.cfg.cpu_decoder)}

    def batch_bytes(self) -> int:
        return self.cfg.batch_size * self.cfg.image_size**2 * 3

    def _host_batches(self):
        # The last iteration's workers are idle or ended: nothing is being written, and the batches an abandoned
        # epoch left in flight are dropped, so every pooled buffer the caller does not hold is free again.
        if self.in_threads:
            self.close()
        self.buffers.release_all()
        self._copying.clear()
        return super()._host_batches()

    def _to_device(self, batch: HostBatch):
        if self.hands_out_buffer:  # lent before anything views it: the caller's views are the lent tensor's
            batch.images = self.buffers.lend(batch.images, batch.slot)
        return super()._to_device(batch)

    def _release(self, batch: HostBatch) -> None:
        if self.hands_out_buffer:
            return  # lent in _to_device
        if self.buffers.pin and self.device.type == "cuda":
            self._after_copy(batch.slot)
        else:
            self.buffers.release(batch.slot)

    def _after_copy(self, slot: int) -> None:
        """A pinned buffer goes back to its worker once its non-blocking copy to the device has run, not when it was
        queued (it is read by the copy until then)."""
        import torch

        if slot >= 0:
            done = torch.cuda.Event()
            done.record()  # on the current stream: the side stream that queued the copy (base.Loader._prefetched)
            self._copying.append((done, slot))
        while self._copying and self._copying[0][0].query():
            self.buffers.release(self._copying.pop(0)[1])

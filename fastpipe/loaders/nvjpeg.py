"""nvjpeg backend: GPU JPEG decoding without DALI.

DataLoader workers only read the JPEG bytes and draw each sample's crop box and flip (the same per-sample draws as
the torch backend); the batch is decoded on the device in one call — TorchCodec's `decode_jpeg` when installed,
else torchvision's (deprecated from 0.29 in favour of TorchCodec) — then cropped, flipped and resized there.
Without a GPU the batch is decoded on the CPU instead, in the main process: by the crop decoder (cpu_ops, the boxes
the workers drew) where fastpipe's C extension is built, else by the same code as on a GPU, on the CPU.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from fastpipe.dataset import imageguard
from fastpipe.loaders import cpu_ops, jpegcrop
from fastpipe.loaders.batch import HostBatch
from fastpipe.loaders.prepare import EncodedBytes, SampleError
from fastpipe.loaders.stream import StreamLoader


def _decoder():
    try:
        from torchcodec.decoders import decode_jpeg

        return "torchcodec", lambda data, device: decode_jpeg(data, mode="RGB", device=device)
    except ImportError:
        from torchvision.io import ImageReadMode, decode_jpeg

        def tv(data, device):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # the TorchCodec notice, once per batch
                return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

        return "torchvision", tv


class NvjpegLoader(StreamLoader):
    name = "nvjpeg"
    unsupported = ("cpu_decoder",)

    def __init__(self, manifest, cfg):
        super().__init__(manifest, cfg)
        self.decoder_name, self._decode = _decoder()
        # On the CPU the crop decoder beats a full decode + float resize, and gives the torch backend's pixels.
        self.crop_on_cpu = self.device.type == "cpu" and jpegcrop.ext is not None and cpu_ops.cv2 is not None

    def make_prepare(self):
        self.max_pixels = imageguard.data_set_limit(self.manifest.settings)
        return EncodedBytes(self.cfg, self.num_classes, self.manifest.multilabel, self.max_pixels)

    def describe(self) -> dict:
        return {**super().describe(), "decoder": cpu_ops.active() if self.crop_on_cpu else self.decoder_name}

    def _failed(self, batch: HostBatch, i: int, e: Exception) -> None:
        s = self.shards
        what = f"sample {s.keys[i]} in shard {s.names[int(s.shard_of(i))]}: {str(e)[:200]}"
        if self.cfg.on_error == "raise":
            raise SampleError(what) from e
        batch.skipped.append(what)

    def _decode_batch(self, batch: HostBatch) -> list[torch.Tensor | None]:
        """One batched call; if it fails, image by image, so that one bad JPEG costs one sample, named."""
        try:
            return list(self._decode(batch.data, self.device))
        except RuntimeError:
            out = []
            for d, i in zip(batch.data, batch.ids.tolist()):
                try:
                    out.append(self._decode([d], self.device)[0])
                except RuntimeError as e:
                    self._failed(batch, i, e)
                    out.append(None)
            return out

    def _crops_on_device(self, batch: HostBatch) -> tuple[list[torch.Tensor], list[int]]:
        """Each decoded sample's box, flipped where drawn, resized: (1, 3, size, size) float crops."""
        images = self._decode_batch(batch)
        size, crops, keep = self.cfg.image_size, [], []
        for i, (img, (x0, y0, x1, y1), flip) in enumerate(zip(images, batch.boxes.tolist(), batch.flips.tolist())):
            if img is None:
                continue
            crop = img[:, y0:y1, x0:x1].unsqueeze(0).float()
            crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            crops.append(crop.flip(-1) if flip else crop)
            keep.append(i)
        return crops, keep

    def _crops_on_cpu(self, batch: HostBatch) -> tuple[list[torch.Tensor], list[int]]:
        """The same boxes and flips by the crop decoder: (1, 3, size, size) uint8 crops."""
        size, crops, keep = self.cfg.image_size, [], []
        pixels = torch.empty((len(batch.data), size, size, 3), dtype=torch.uint8)
        for i, (data, box, flip) in enumerate(zip(batch.data, batch.boxes.tolist(), batch.flips.tolist())):
            try:
                cpu_ops.decode_box(data.numpy(), size, box, flip, pixels[i].numpy(), self.max_pixels)
            except Exception as e:  # any decoder failure is this sample's problem, named as on the device
                self._failed(batch, int(batch.ids[i]), e)
                continue
            crops.append(pixels[i : i + 1].permute(0, 3, 1, 2))
            keep.append(i)
        return crops, keep

    def _to_device(self, batch: HostBatch):
        n, size = len(batch.data), self.cfg.image_size
        crops, keep = self._crops_on_cpu(batch) if self.crop_on_cpu else self._crops_on_device(batch)
        if not keep and n:
            raise SampleError(f"none of the {n} samples of a batch decodes on {self.device}: the shards "
                              f"are damaged; run `fastpipe inspect --verify`")
        if self.cfg.split == "train" and len(keep) < n:  # keep the batch shape: copies of good samples
            keep = [keep[k % len(keep)] for k in range(n)]
            crops = [crops[k % len(crops)] for k in range(n)]
        x = torch.cat(crops) if crops else torch.empty((0, 3, size, size), device=self.device)
        batch.ids = batch.ids[keep]
        return self.step.finish(x), self.step.labels(batch.labels[keep])

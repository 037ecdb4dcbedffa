"""nvjpeg backend: GPU JPEG decoding without DALI.

DataLoader workers only read the JPEG bytes and draw each sample's crop box and flip (the same per-sample draws as
the torch backend); the batch is decoded on the device in one call — TorchCodec's `decode_jpeg` when installed,
else torchvision's (deprecated from 0.29 in favour of TorchCodec) — then cropped, flipped and resized there.
Without a GPU the same code decodes on the CPU, which is how CI tests it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

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

    def make_prepare(self):
        return EncodedBytes(self.cfg, self.num_classes, self.manifest.multilabel)

    def describe(self) -> dict:
        return {**super().describe(), "decoder": self.decoder_name}

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
                    s = self.shards
                    what = f"sample {s.keys[i]} in shard {s.names[int(s.shard_of(i))]}: {str(e)[:200]}"
                    if self.cfg.on_error == "raise":
                        raise SampleError(what) from e
                    batch.skipped.append(what)
                    out.append(None)
            return out

    def _to_device(self, batch: HostBatch):
        images = self._decode_batch(batch)
        size, crops, keep = self.cfg.image_size, [], []
        for i, (img, (x0, y0, x1, y1), flip) in enumerate(zip(images, batch.boxes.tolist(), batch.flips.tolist())):
            if img is None:
                continue
            crop = img[:, y0:y1, x0:x1].unsqueeze(0).float()
            crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            crops.append(crop.flip(-1) if flip else crop)
            keep.append(i)
        if not keep and len(images):
            raise SampleError(f"none of the {len(images)} samples of a batch decodes on {self.device}: the shards "
                              f"are damaged; run `fastpipe inspect --verify`")
        if self.cfg.split == "train" and len(keep) < len(images):  # keep the batch shape: copies of good samples
            keep = [keep[k % len(keep)] for k in range(len(images))]
            crops = [crops[k % len(crops)] for k in range(len(images))]
        x = torch.cat(crops) if crops else torch.empty((0, 3, size, size), device=self.device)
        batch.ids = batch.ids[keep]
        return self.step.finish(x), self.step.labels(batch.labels[keep])

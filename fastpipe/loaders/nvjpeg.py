"""nvjpeg backend: GPU JPEG decoding without DALI.

DataLoader workers only read the JPEG bytes and draw each sample's crop box and flip (the same draws as the
torch backend); the batch is decoded on the device in one call — TorchCodec's `decode_jpeg` when installed,
else torchvision's (deprecated from 0.29 in favour of TorchCodec) — then cropped, flipped and resized there.
Without a GPU the same code decodes on the CPU, which is how CI tests it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from fastpipe.loaders.torch_wds import TorchLoader


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


class NvjpegLoader(TorchLoader):
    name = "nvjpeg"
    mode = "bytes"

    def __init__(self, manifest, cfg):
        super().__init__(manifest, cfg)
        self.decoder_name, self._decode = _decoder()

    def describe(self) -> dict:
        return {**super().describe(), "decoder": self.decoder_name}

    def _decode_batch(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """One batched call; if it fails, image by image, so that one bad JPEG costs one sample."""
        try:
            return list(self._decode(datas, self.device))
        except RuntimeError:
            out = []
            for d in datas:
                try:
                    out.append(self._decode([d], self.device)[0])
                except RuntimeError as e:
                    if self.cfg.on_error == "raise":
                        raise
                    warnings.warn(f"skipping an undecodable JPEG in a {self.cfg.split} batch: {e}", stacklevel=2)
                    out.append(None)
            return out

    def _to_device(self, batch):
        datas, boxes, flips, labels, skipped = batch
        images = self._decode_batch(datas)
        size = self.cfg.image_size
        crops, keep = [], []
        for i, (img, (x0, y0, x1, y1), flip) in enumerate(zip(images, boxes.tolist(), flips.tolist())):
            if img is None:
                continue
            crop = img[:, y0:y1, x0:x1].unsqueeze(0).float()
            crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            crops.append(crop.flip(-1) if flip else crop)
            keep.append(i)
        x = torch.cat(crops) if crops else torch.empty((0, 3, size, size), device=self.device)
        y = labels[keep] if len(keep) != len(labels) else labels
        return self.step.finish(x), self.step.labels(y), skipped + len(labels) - len(keep)

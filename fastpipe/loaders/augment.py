"""Augmentation on the device, batch-wise, for every backend: after the shared uint8 → device step, before (pixel
ops) and after (erasing, mixing) normalisation. Train batches only; val never augments.

    augment="randaug:2:9,mixup:0.2,cutmix:1.0"     (LoaderConfig.augment, fastpipe train --augment)

    randaug:N:M      RandAugment, N ops per image at magnitude M (0-30), torchvision's op set and ranges
    trivialaug       TrivialAugmentWide: one op per image at a random magnitude
    jitter:B:C:S[:H] colour jitter: brightness, contrast, saturation factors in [1-x, 1+x], hue shift in [-H, H]
    erase:P          random erasing with probability P (timm's 'pixel' mode: normal noise, 2-33 % of the area)
    mixup:A[:P]      mixup with Beta(A, A) weights, applied to a batch with probability P (default 1)
    cutmix:A[:P]     cutmix likewise; with both, each mixed batch is one or the other, half and half (timm)

Mixing turns the labels into soft targets (N, K) that sum to 1 (label smoothing folded in, as timm does), or mixes
multi-hot targets for multi-label data; cross-entropy takes them as they are. Every draw comes from a generator
seeded by (seed, epoch, the batch's position in the epoch, rank), so a resumed run repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastpipe.errors import ConfigError
from fastpipe.loaders import imageops as ops
from fastpipe.options import check_number

FORMS = {"randaug": "randaug:N:M", "trivialaug": "trivialaug", "jitter": "jitter:B:C:S[:H]", "erase": "erase:P",
         "mixup": "mixup:A[:P]", "cutmix": "cutmix:A[:P]"}
NAMES = tuple(FORMS)


@dataclass(frozen=True)
class AugmentSpec:
    randaug: tuple[int, int] | None = None
    trivialaug: bool = False
    jitter: tuple[float, float, float, float] | None = None
    erase: float = 0.0
    mixup: tuple[float, float] | None = None  # (alpha, probability)
    cutmix: tuple[float, float] | None = None

    @property
    def mixing(self) -> bool:
        return bool(self.mixup or self.cutmix)

    @property
    def pixel_ops(self) -> bool:
        """Ops that change pixels image by image before normalising (erase runs after, mixing on the batch)."""
        return bool(self.randaug or self.trivialaug or self.jitter)


# Each form's arguments: (name, int or float, low, high); the optional ones last. Ranges are those of the
# references (torchvision's RandAugment magnitudes 0..30, ColorJitter's hue <= 0.5, probabilities 0..1); N and alpha
# are capped where more is no longer a different augmentation but a batch that never finishes.
ARGS = {"randaug": (("N", int, 1, 16), ("M", int, 0, 30)), "trivialaug": (),
        "jitter": (("brightness", float, 0, 1), ("contrast", float, 0, 1), ("saturation", float, 0, 1),
                   ("hue", float, 0, 0.5)),
        "erase": (("P", float, 0, 1),), "mixup": (("A", float, 0, 100), ("P", float, 0, 1)),
        "cutmix": (("A", float, 0, 100), ("P", float, 0, 1))}
REQUIRED = {"randaug": 2, "trivialaug": 0, "jitter": 3, "erase": 1, "mixup": 1, "cutmix": 1}


def _numbers(part: str, name: str, args: list[str]) -> list[float]:
    """The arguments of one form, each checked against its type and range (NaN and infinity refused)."""
    specs = ARGS[name]
    if not REQUIRED[name] <= len(args) <= len(specs):
        raise ConfigError(f"augment {part!r}: use {FORMS[name]}")
    values = []
    for text, (what, kind, low, high) in zip(args, specs):
        try:
            value = kind(text) if kind is int else float(text)
        except ValueError:
            raise ConfigError(f"augment {part!r}: {what} {text!r} is not {'an integer' if kind is int else 'a number'}"
                              f" (use {FORMS[name]})") from None
        values.append(check_number(f"augment {part!r}: {what}", value, kind, low, high))
    return values


def parse(text: str | None) -> AugmentSpec:
    """'randaug:2:9,mixup:0.2' → AugmentSpec; an unknown name or a value outside its range is refused with the
    valid forms."""
    d: dict = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, *args = part.split(":")
        if name not in FORMS:
            raise ConfigError(f"augment {name!r} is not known: use {', '.join(FORMS.values())} "
                              f"(e.g. randaug:2:9,mixup:0.2)")
        d[name] = _numbers(part, name, args)
    mix = {k: (d[k][0], d[k][1] if len(d[k]) > 1 else 1.0) for k in ("mixup", "cutmix") if k in d}
    j = d.get("jitter")
    return AugmentSpec(randaug=(int(d["randaug"][0]), int(d["randaug"][1])) if "randaug" in d else None,
                       trivialaug="trivialaug" in d, jitter=(*j, 0.0)[:4] if j else None,
                       erase=d.get("erase", [0.0])[0], mixup=mix.get("mixup"), cutmix=mix.get("cutmix"))


def mixes(text: str | None) -> bool:
    return parse(text).mixing


# RandAugment / TrivialAugmentWide: (op, maximum magnitude, signed) per op; magnitude bins 0..30.
RANDAUG = [(None, 0, False), (ops.shear_x, 0.3, True), (ops.shear_y, 0.3, True), (ops.translate_x, 150 / 331, True),
           (ops.translate_y, 150 / 331, True), (ops.rotate, 30.0, True), (ops.brightness, 0.9, True),
           (ops.saturation, 0.9, True), (ops.contrast, 0.9, True), (ops.sharpness, 0.9, True),
           (ops.posterize, 4, False), (ops.solarize, 255.0, False), (ops.autocontrast, 0, False),
           (ops.equalize, 0, False)]
TRIVIAL = [(None, 0, False), (ops.shear_x, 0.99, True), (ops.shear_y, 0.99, True), (ops.translate_x, 32.0, True),
           (ops.translate_y, 32.0, True), (ops.rotate, 135.0, True), (ops.brightness, 0.99, True),
           (ops.saturation, 0.99, True), (ops.contrast, 0.99, True), (ops.sharpness, 0.99, True),
           (ops.posterize, 6, False), (ops.solarize, 255.0, False), (ops.autocontrast, 0, False),
           (ops.equalize, 0, False)]


def _values(op, top: float, signed: bool, level: torch.Tensor, sign: torch.Tensor, width: int) -> torch.Tensor:
    """torchvision's magnitude → parameter for each sample."""
    v = level / 30 * top
    if op in (ops.translate_x, ops.translate_y) and top < 1:
        v = v * width  # RandAugment's translation is a fraction of the image
    if op in (ops.brightness, ops.saturation, ops.contrast, ops.sharpness):
        return 1 + v * sign
    if op is ops.posterize:
        return 8 - v.floor()
    if op is ops.solarize:
        return 255 - v
    return v * sign if signed else v


class DeviceAugment:
    def __init__(self, spec: AugmentSpec, num_classes: int, multilabel: bool, smoothing: float, seed: int):
        self.spec, self.k, self.multilabel, self.smoothing, self.seed = spec, num_classes, multilabel, smoothing, seed

    def generator(self, device: torch.device, key: tuple[int, ...]) -> tuple[torch.Generator, np.random.Generator]:
        """(torch generator on the batch's device, numpy generator for per-batch scalars), from the batch's key."""
        host = np.random.default_rng([self.seed, *key])
        g = torch.Generator(device=device)
        g.manual_seed(int(host.integers(2**62)))
        return g, host

    def pixels(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """RandAugment / TrivialAugmentWide / colour jitter on float NCHW 0..255."""
        s, n = self.spec, len(x)
        rounds = [(RANDAUG, torch.full((n,), float(s.randaug[1]), device=x.device)) for _ in range(s.randaug[0])] \
            if s.randaug else []
        if s.trivialaug:
            rounds.append((TRIVIAL, torch.randint(0, 31, (n,), generator=g, device=x.device).float()))
        for table, level in rounds:
            choice = torch.randint(0, len(table), (n,), generator=g, device=x.device)
            sign = torch.where(torch.rand(n, generator=g, device=x.device) < 0.5, -1.0, 1.0)
            for i, (op, top, signed) in enumerate(table):
                if op is not None:
                    x = ops.apply(op, x, _values(op, top, signed, level, sign, x.shape[-1]), choice == i)
        if s.jitter:
            x = self._jitter(x, g)
        return x

    def _jitter(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        n, every = len(x), torch.ones(len(x), dtype=torch.bool, device=x.device)
        for op, width in zip((ops.brightness, ops.contrast, ops.saturation), self.spec.jitter[:3]):
            if width:
                f = 1 + (torch.rand(n, generator=g, device=x.device) * 2 - 1) * width
                x = ops.apply(op, x, f.clamp(min=0), every)
        if self.spec.jitter[3]:
            shift = (torch.rand(n, generator=g, device=x.device) * 2 - 1) * self.spec.jitter[3]
            x = ops.apply(ops.hue, x, shift, every)
        return x

    def erase(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """timm RandomErasing, 'pixel' mode, on normalised images: one box of 2-33 % of the area, normal noise."""
        n, _, h, w = x.shape
        dev = x.device
        area = h * w * (0.02 + torch.rand(n, generator=g, device=dev) * (1 / 3 - 0.02))
        aspect = torch.exp(np.log(0.3) + torch.rand(n, generator=g, device=dev) * (np.log(3.3) - np.log(0.3)))
        bh = (area * aspect).sqrt().round().clamp(1, h)
        bw = (area / aspect).sqrt().round().clamp(1, w)
        top = (torch.rand(n, generator=g, device=dev) * (h - bh + 1)).floor()
        left = (torch.rand(n, generator=g, device=dev) * (w - bw + 1)).floor()
        rows, cols = torch.arange(h, device=dev).view(1, h, 1), torch.arange(w, device=dev).view(1, 1, w)
        box = ((rows >= top.view(-1, 1, 1)) & (rows < (top + bh).view(-1, 1, 1)) & (cols >= left.view(-1, 1, 1))
               & (cols < (left + bw).view(-1, 1, 1)))
        box &= (torch.rand(n, generator=g, device=dev) < self.spec.erase).view(-1, 1, 1)
        noise = torch.randn(x.shape, generator=g, device=dev, dtype=x.dtype)
        return torch.where(box.unsqueeze(1), noise, x)

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        """Labels as rows of class probabilities (smoothed), or multi-hot rows as they are."""
        if self.multilabel:
            return y.float()
        off = self.smoothing / self.k
        return torch.full((len(y), self.k), off, device=y.device).scatter_(1, y.view(-1, 1), 1 - self.smoothing + off)

    def mix(self, x: torch.Tensor, y: torch.Tensor, host: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """timm's batch mode: mixup or cutmix with the batch flipped; returns images and soft targets."""
        s, t = self.spec, self.targets(y)
        use_cutmix = bool(s.cutmix) and (not s.mixup or host.random() < 0.5)
        alpha, prob = s.cutmix if use_cutmix else s.mixup
        if host.random() >= prob or alpha <= 0:
            return x, t
        lam = float(host.beta(alpha, alpha))
        if use_cutmix:
            h, w = x.shape[-2:]
            ch, cw = int(h * np.sqrt(1 - lam)), int(w * np.sqrt(1 - lam))
            cy, cx = int(host.integers(h)), int(host.integers(w))
            y0, y1, x0, x1 = max(cy - ch // 2, 0), min(cy + ch // 2, h), max(cx - cw // 2, 0), min(cx + cw // 2, w)
            x = x.clone()
            x[..., y0:y1, x0:x1] = x.flip(0)[..., y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
        else:
            x = x * lam + x.flip(0) * (1 - lam)
        return x, t * lam + t.flip(0) * (1 - lam)

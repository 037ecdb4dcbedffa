"""Batched image operations with a value per sample, on whatever device the batch is on (the GPU, or the CPU
where there is none): x is float NCHW in 0..255, `m` a per-sample magnitude (N,), `mask` which samples the
operation applies to. They follow torchvision's definitions (RandAugment / TrivialAugmentWide) but apply a
different op and magnitude to each sample of the batch in one call per op, instead of one per image."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GRAY = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    return (x * GRAY.to(x.device, x.dtype)).sum(1, keepdim=True)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: other + factor x (x - other), clamped; factor per sample."""
    return (other + factor.view(-1, 1, 1, 1) * (x - other)).clamp_(0, 255)


def brightness(x, f):
    return _blend(x, torch.zeros_like(x), f)


def saturation(x, f):
    return _blend(x, _gray(x).expand_as(x), f)


def contrast(x, f):
    return _blend(x, _gray(x).mean((2, 3), keepdim=True).expand_as(x), f)


def sharpness(x, f):
    kernel = torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]], device=x.device, dtype=x.dtype) / 13
    smooth = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernel.expand(3, 1, 3, 3), groups=3)
    smooth[..., 0, :], smooth[..., -1, :], smooth[..., :, 0], smooth[..., :, -1] = (
        x[..., 0, :], x[..., -1, :], x[..., :, 0], x[..., :, -1])  # PIL leaves the border as it was
    return _blend(x, smooth, f)


def posterize(x, bits):
    step = (2.0 ** (8 - bits.round())).view(-1, 1, 1, 1)
    return torch.floor(x / step) * step


def solarize(x, threshold):
    return torch.where(x >= threshold.view(-1, 1, 1, 1), 255 - x, x)


def autocontrast(x, _m=None):
    lo, hi = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    scale = torch.where(hi > lo, 255 / (hi - lo).clamp(min=1e-6), torch.ones_like(hi))
    return torch.where(hi > lo, (x - lo) * scale, x).clamp_(0, 255)


def equalize(x, _m=None):
    """Per image and channel, torchvision's histogram equalisation, all images at once."""
    n, c, h, w = x.shape
    v = x.round().clamp(0, 255).long().reshape(n * c, -1)
    hist = torch.zeros(n * c, 256, device=x.device).scatter_add_(1, v, torch.ones_like(v, dtype=torch.float))
    last = 255 - torch.flip(hist > 0, [1]).float().argmax(1, keepdim=True)  # the largest value present
    step = torch.div(hist.sum(1, keepdim=True) - hist.gather(1, last), 255, rounding_mode="floor")
    lut = torch.div(hist.cumsum(1) + torch.div(step, 2, rounding_mode="floor"), step.clamp(min=1),
                    rounding_mode="floor")
    lut = torch.cat([torch.zeros_like(lut[:, :1]), lut[:, :-1]], 1).clamp(0, 255)
    out = lut.gather(1, v).view(n, c, h, w).to(x.dtype)
    return torch.where((step > 0).view(n, c, 1, 1), out, x)


def _affine(x, theta):
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _matrix(n, device, a=None, b=None, c=None, d=None, tx=None, ty=None):
    """Per-sample 2x3 affine matrices (output → input coordinates, in [-1, 1] units)."""
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0], theta[:, 1, 1] = 1, 1
    for (i, j), v in {(0, 0): a, (0, 1): b, (1, 0): c, (1, 1): d, (0, 2): tx, (1, 2): ty}.items():
        if v is not None:
            theta[:, i, j] = v
    return theta


def shear_x(x, s):
    h, w = x.shape[-2:]
    return _affine(x, _matrix(len(x), x.device, b=s * h / w))  # pixel-space shear, in [-1, 1] units


def shear_y(x, s):
    h, w = x.shape[-2:]
    return _affine(x, _matrix(len(x), x.device, c=s * w / h))


def translate_x(x, pixels):
    return _affine(x, _matrix(len(x), x.device, tx=-2 * pixels / x.shape[-1]))


def translate_y(x, pixels):
    return _affine(x, _matrix(len(x), x.device, ty=-2 * pixels / x.shape[-2]))


def rotate(x, degrees):
    """Counter-clockwise for positive degrees (torchvision's sense), about the centre, in pixel space."""
    h, w = x.shape[-2:]
    r = degrees * math.pi / 180
    cos, sin = torch.cos(r), torch.sin(r)
    return _affine(x, _matrix(len(x), x.device, a=cos, b=-sin * h / w, c=sin * w / h, d=cos))


def hue(x, shift):
    """Rotate the chroma by `shift` turns in YIQ space (a cheap stand-in for an HSV hue shift)."""
    to_yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], device=x.device)
    yiq = torch.einsum("ij,njhw->nihw", to_yiq, x)
    a = 2 * math.pi * shift.view(-1, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], i * torch.cos(a) - q * torch.sin(a), i * torch.sin(a) + q * torch.cos(a)], 1)
    return torch.einsum("ij,njhw->nihw", torch.linalg.inv(to_yiq), yiq).clamp_(0, 255)


def apply(op, x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with `op(values)` applied to the samples in `mask` (the others untouched)."""
    if not bool(mask.any()):
        return x
    idx = mask.nonzero().squeeze(1)
    x = x.clone()
    x[idx] = op(x[idx], values[idx])
    return x

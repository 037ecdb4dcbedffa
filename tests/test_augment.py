"""Augmentation on the device: each op against torchvision's own definition, ranges, dtype/shape/device kept,
mixup/cutmix targets that match the mixed pixels, determinism, and the loaders and training using them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from fastpipe import make_loader
from fastpipe.errors import ConfigError
from fastpipe.loaders import imageops as ops
from fastpipe.loaders.augment import DeviceAugment, parse

B = TF.InterpolationMode.BILINEAR


@pytest.fixture
def imgs():
    torch.manual_seed(0)
    x8 = torch.randint(0, 256, (4, 3, 40, 50), dtype=torch.uint8)
    return x8, x8.float()


def v(value):
    return torch.full((4,), float(value))


@pytest.mark.parametrize("mine,ref,tol", [
    (lambda x: ops.brightness(x, v(1.7)), lambda x8: TF.adjust_brightness(x8, 1.7), 1.0),
    (lambda x: ops.saturation(x, v(0.3)), lambda x8: TF.adjust_saturation(x8, 0.3), 2.0),
    (lambda x: ops.contrast(x, v(1.5)), lambda x8: TF.adjust_contrast(x8, 1.5), 1.0),
    (lambda x: ops.sharpness(x, v(1.8)), lambda x8: TF.adjust_sharpness(x8, 1.8), 2.0),
    (lambda x: ops.posterize(x, v(4)), lambda x8: TF.posterize(x8, 4), 0.0),
    (lambda x: ops.solarize(x, v(128)), lambda x8: TF.solarize(x8, 128), 0.0),
    (ops.autocontrast, TF.autocontrast, 0.0),
    (ops.equalize, TF.equalize, 0.0),
])
def test_colour_ops_match_torchvision(imgs, mine, ref, tol):
    x8, x = imgs
    out = mine(x)
    assert out.shape == x.shape and out.dtype == torch.float32 and out.min() >= 0 and out.max() <= 255
    assert (out - ref(x8).float()).abs().max() <= tol + 1e-3  # within uint8 rounding


@pytest.mark.parametrize("mine,ref", [
    (lambda x: ops.rotate(x, v(20)), lambda x: TF.rotate(x, 20, interpolation=B)),
    (lambda x: ops.shear_x(x, v(0.2)), lambda x: TF.affine(x, 0, [0, 0], 1, [math.degrees(math.atan(0.2)), 0],
                                                          interpolation=B)),
    (lambda x: ops.shear_y(x, v(0.2)), lambda x: TF.affine(x, 0, [0, 0], 1, [0, math.degrees(math.atan(0.2))],
                                                          interpolation=B)),
    (lambda x: ops.translate_x(x, v(5)), lambda x: TF.affine(x, 0, [5, 0], 1, [0, 0], interpolation=B)),
    (lambda x: ops.translate_y(x, v(-7)), lambda x: TF.affine(x, 0, [0, -7], 1, [0, 0], interpolation=B)),
])
def test_geometric_ops_match_torchvision_on_a_non_square_image(imgs, mine, ref):
    x = torch.nn.functional.avg_pool2d(imgs[1], 5, 1, 2)
    assert (mine(x) - ref(x)).abs().mean() < 0.01


def test_per_sample_values_and_masks(imgs):
    _, x = imgs
    out = ops.apply(ops.brightness, x, torch.tensor([1.0, 0.0, 1.0, 2.0]), torch.tensor([True, True, False, False]))
    assert torch.equal(out[0], x[0]) and out[1].max() == 0 and torch.equal(out[2], x[2]) and torch.equal(out[3], x[3])


def _aug(text, k=3, multilabel=False, smoothing=0.0):
    return DeviceAugment(parse(text), k, multilabel, smoothing, seed=0)


@pytest.mark.parametrize("text", ["randaug:2:9", "trivialaug", "jitter:0.4:0.4:0.4:0.1"])
def test_pixel_augmentations_keep_shape_range_and_are_deterministic(imgs, text):
    _, x = imgs
    aug = _aug(text)
    a = aug.pixels(x, aug.generator(x.device, (1, 0, 0))[0])
    b = aug.pixels(x, aug.generator(x.device, (1, 0, 0))[0])
    c = aug.pixels(x, aug.generator(x.device, (1, 64, 0))[0])
    assert a.shape == x.shape and a.dtype == x.dtype and a.device == x.device
    assert a.min() >= 0 and a.max() <= 255 and not torch.equal(a, x)
    assert torch.equal(a, b) and not torch.equal(a, c)  # the batch's key fixes the draws


def test_random_erasing_covers_2_to_33_percent(imgs):
    x = torch.zeros(64, 3, 40, 50)
    aug = _aug("erase:1")
    out = aug.erase(x, aug.generator(x.device, (0, 0, 0))[0])
    share = (out != 0).any(1).float().mean((1, 2))
    assert share.min() >= 0.015 and share.max() <= 0.34 and out.dtype == x.dtype


def test_mixup_targets_sum_to_one_and_match_the_pixels():
    x = torch.arange(4).float().view(4, 1, 1, 1).expand(4, 3, 8, 8) * 10  # image i is constant 10 i
    y = torch.tensor([0, 1, 2, 0])
    aug = _aug("mixup:0.4", smoothing=0.0)
    out, t = aug.mix(x, y, np.random.default_rng(1))
    assert torch.allclose(t.sum(1), torch.ones(4))
    lam = t[1, 1].item()  # image 1 (label 1) is mixed with image 2 (label 2)
    assert out[1, 0, 0, 0].item() == pytest.approx(10 * lam + 20 * (1 - lam), abs=1e-4)


def test_cutmix_targets_match_the_pasted_area():
    x = torch.cat([torch.zeros(1, 3, 20, 20), torch.ones(1, 3, 20, 20)])
    aug = _aug("cutmix:1.0")
    for seed in range(5):
        out, t = aug.mix(x, torch.tensor([0, 1]), np.random.default_rng(seed))
        pasted = out[0, 0].mean().item()  # the share of image 0 now showing image 1
        assert t[0, 1].item() == pytest.approx(pasted, abs=1e-6) and torch.allclose(t.sum(1), torch.ones(2))


def test_smoothing_is_folded_into_soft_targets():
    t = _aug("mixup:0.2:0", smoothing=0.3).targets(torch.tensor([2, 0]))
    assert t[0, 2].item() == pytest.approx(0.8) and t[0, 0].item() == pytest.approx(0.1)


def test_unknown_or_malformed_specs_are_refused_with_the_valid_list():
    with pytest.raises(ConfigError, match="randaug:N:M, trivialaug, jitter"):
        parse("autoaug")
    with pytest.raises(ConfigError, match="use mixup:A"):
        parse("mixup")
    with pytest.raises(ConfigError, match=r"within 0\.\.1"):
        parse("erase:1.5")


@pytest.mark.parametrize("spec,says", [
    ("jitter:nan:0:0", "brightness nan: must be a finite number"), ("jitter:inf:0:0", "brightness inf"),
    ("jitter:0.4:0.4:0.4:0.9", r"hue 0\.9: must be within 0\.\.0\.5"), ("mixup:nan", "A nan"),
    ("mixup:inf", "A inf"), ("erase:nan", "P nan"), ("cutmix:1.0:nan", "P nan"),
    ("randaug:1000000:30", r"N 1000000: must be within 1\.\.16"), ("randaug:2:9.5", "M '9.5' is not an integer"),
    ("randaug:2:31", r"M 31: must be within 0\.\.30"), ("mixup:-0.2", "A -0.2"), ("jitter:0.4", "use jitter:B:C:S"),
])
def test_every_augmentation_number_is_checked(spec, says):
    """NaN trained every step on NaN; randaug with a million ops never finished a batch: refused when parsed."""
    with pytest.raises(ConfigError, match=says):
        parse(spec)


def test_the_loader_augments_train_batches_only(converted):
    kw = dict(batch_size=8, image_size=48, device="cpu", num_workers=0, seed=2)
    plain = make_loader(converted, "torch", **kw)
    mixed = make_loader(converted, "torch", augment="randaug:2:9,cutmix:1.0", label_smoothing=0.1, **kw)
    (x0, y0), (x1, y1) = next(iter(plain)), next(iter(mixed))
    assert x1.shape == x0.shape and x1.dtype == x0.dtype and not torch.equal(x0, x1)
    assert y1.shape == (8, 3) and torch.allclose(y1.sum(1), torch.ones(8))  # soft targets
    assert torch.equal(y1.argmax(1), y0) or (y1.max(1).values < 1).all()
    again = make_loader(converted, "torch", augment="randaug:2:9,cutmix:1.0", label_smoothing=0.1, **kw)
    assert torch.equal(next(iter(again))[0], x1)  # same seed, epoch and position: same augmentation
    val = make_loader(converted, "torch", split="val", augment="randaug:2:9,mixup:0.2", **kw)
    vplain = make_loader(converted, "torch", split="val", **kw)
    assert torch.equal(next(iter(val))[0], next(iter(vplain))[0])


def test_training_with_mixup_records_the_spec(converted, tmp_path):
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import train

    run = train(TrainConfig(data=str(converted), out=str(tmp_path / "r"), batch_size=8, image_size=32, workers=0,
                            device="cpu", epochs=1, optimizer="adamw", lr=1e-3, augment="mixup:0.2,trivialaug"))
    assert json.loads((run / "config.json").read_text())["train"]["augment"] == "mixup:0.2,trivialaug"
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert m["train_loss"] == m["train_loss"] and m["val_acc"] >= 0

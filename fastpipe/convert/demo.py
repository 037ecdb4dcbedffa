"""`fastpipe demo-data`: a procedural stand-in for the users' own photos.

Six classes in two families, leaves (healthy / rust / blight) and pipeline surfaces (clean / crack / corrosion),
drawn at a quarter of the final size, upscaled, and covered with camera-like grain so that a JPEG costs what a
real 8-megapixel photo costs to decode. Counts are imbalanced 20:1 and a few dirty files are mixed in, so
every rejection path of the converter shows up in the demo.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from tqdm import tqdm

from fastpipe.options import SEED_MAX, check, opt, parse_procs
from fastpipe.store.urls import local_path
from fastpipe.util import usable_cores

# Relative class frequencies: healthy leaves are common, corrosion is rare (20:1).
CLASSES = {
    "leaf_healthy": 20,
    "leaf_rust": 9,
    "leaf_blight": 5,
    "pipe_clean": 14,
    "pipe_crack": 4,
    "pipe_corrosion": 1,
}


@dataclass(frozen=True)
class DemoConfig:
    out: Path = opt(None, "folder for the photos (one folder per class)", positional=True)
    count: int = opt(180, "number of photos", low=1, high=10_000_000)
    width: int = opt(3264, "photo width in pixels", low=16, high=20_000)
    height: int = opt(2448, "photo height in pixels", low=16, high=20_000)
    seed: int = opt(0, "seed: the same seed gives the same bytes", low=0, high=SEED_MAX)
    workers: int | None = opt(None, "processes: a number (0 = in this process) or auto (every core)",
                              parse=parse_procs, low=0, high=1024)
    portrait_fraction: float = opt(0.2, "share of photos taken in portrait orientation", low=0, high=1)

    def __post_init__(self):
        object.__setattr__(self, "out", local_path(self.out, "OUT"))
        check(self)


def class_counts(total: int) -> dict[str, int]:
    weights = np.array(list(CLASSES.values()), dtype=float)
    counts = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(int)
    counts[0] += max(0, total - counts.sum())  # the remainder goes to the majority class
    return dict(zip(CLASSES, counts.tolist()))


def _grain(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Sensor-like noise: a random 512² tile, tiled with a random offset (cheap at 8 megapixels)."""
    tile = rng.normal(0, 7, size=(512, 512, 3)).astype(np.int16)
    reps = (math.ceil(h / 512) + 1, math.ceil(w / 512) + 1, 1)
    oy, ox = rng.integers(0, 512, size=2)
    return np.tile(tile, reps)[oy : oy + h, ox : ox + w]


def _leaf(draw: ImageDraw.ImageDraw, rng, w, h, kind: str) -> None:
    draw.rectangle([0, 0, w, h], fill=tuple(int(c) for c in rng.integers([70, 55, 35], [110, 90, 60])))
    cx, cy = w / 2 + rng.normal(0, w * 0.04), h / 2 + rng.normal(0, h * 0.04)
    rx, ry = w * rng.uniform(0.3, 0.42), h * rng.uniform(0.25, 0.38)
    green = tuple(int(c) for c in rng.integers([40, 120, 30], [80, 170, 60]))
    if kind == "leaf_blight":
        green = (green[0] + 40, green[1], green[2])  # yellowing
    draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=green)
    vein = tuple(min(255, c + 50) for c in green)
    draw.line([cx - rx, cy, cx + rx, cy], fill=vein, width=max(2, int(w / 200)))
    for t in np.linspace(-0.7, 0.7, 7):
        x = cx + t * rx
        draw.line([x, cy, x + rx * 0.25, cy - ry * 0.6 * (1 - abs(t))], fill=vein, width=max(1, int(w / 400)))
    if kind == "leaf_rust":
        for _ in range(rng.integers(25, 60)):
            a, r = rng.uniform(0, 2 * math.pi), math.sqrt(rng.uniform(0, 0.8))
            x, y, s = cx + r * rx * math.cos(a), cy + r * ry * math.sin(a), rng.uniform(w / 180, w / 80)
            draw.ellipse([x - s, y - s, x + s, y + s], fill=(int(rng.integers(170, 220)), 90, 20))
    elif kind == "leaf_blight":
        for _ in range(rng.integers(3, 6)):
            a, r = rng.uniform(0, 2 * math.pi), math.sqrt(rng.uniform(0, 0.6))
            x, y = cx + r * rx * math.cos(a), cy + r * ry * math.sin(a)
            pts = [(x + rng.uniform(0.05, 0.14) * w * math.cos(t), y + rng.uniform(0.05, 0.14) * w * math.sin(t))
                   for t in np.linspace(0, 2 * math.pi, 9)[:-1]]
            draw.polygon(pts, fill=(int(rng.integers(60, 100)), 45, 25))


def _pipe(draw: ImageDraw.ImageDraw, rng, w, h, kind: str) -> None:
    draw.rectangle([0, 0, w, h], fill=(int(rng.integers(90, 130)),) * 3)
    top, bottom = h * rng.uniform(0.15, 0.3), h * rng.uniform(0.7, 0.85)
    base = rng.uniform(130, 175)
    for i, y in enumerate(np.arange(top, bottom, 2)):  # cylinder shading
        shade = int(base + 60 * math.sin(math.pi * i * 2 / (bottom - top)))
        draw.line([0, y, w, y], fill=(shade, shade, int(shade * 1.04)), width=2)
    if kind == "pipe_crack":
        x, y = rng.uniform(0.1, 0.3) * w, rng.uniform(top, bottom)
        pts = [(x, y)]
        while x < w * rng.uniform(0.7, 0.9):
            x += rng.uniform(w / 60, w / 25)
            y = float(np.clip(y + rng.normal(0, h / 40), top, bottom))
            pts.append((x, y))
        draw.line(pts, fill=(25, 22, 20), width=max(3, int(w / 120)))
    elif kind == "pipe_corrosion":
        for _ in range(rng.integers(8, 20)):
            x, y = rng.uniform(0, w), rng.uniform(top, bottom)
            s = rng.uniform(w / 60, w / 15)
            draw.ellipse([x - s, y - s * 0.6, x + s, y + s * 0.6],
                         fill=(int(rng.integers(120, 170)), int(rng.integers(50, 80)), 25))


def render(kind: str, width: int, height: int, seed: int) -> Image.Image:
    """One photo of class `kind`, deterministic for `seed`."""
    rng = np.random.default_rng(seed)
    sw, sh = max(8, width // 4), max(8, height // 4)
    small = Image.new("RGB", (sw, sh))
    (_leaf if kind.startswith("leaf") else _pipe)(ImageDraw.Draw(small), rng, sw, sh, kind)
    small = small.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.2)))
    big = np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    big = np.clip(big + _grain(rng, height, width), 0, 255).astype(np.uint8)
    return Image.fromarray(big, "RGB")


def _job(args) -> str:
    path, kind, w, h, seed, dirt = args
    im = render(kind, w, h, seed)
    buf = io.BytesIO()
    if dirt == "rgba":
        alpha = Image.new("L", im.size, 255)
        ImageDraw.Draw(alpha).ellipse([0, 0, w // 3, h // 3], fill=0)
        im.putalpha(alpha)
        im.save(buf, "PNG", compress_level=1)
    elif dirt == "gray":
        im.convert("L").save(buf, "JPEG", quality=90)
    elif dirt == "rotated":
        # Stored sideways with an EXIF "rotate 90° CW" tag, as phones do.
        exif = Image.Exif()
        exif[0x0112] = 6
        im.transpose(Image.Transpose.ROTATE_90).save(buf, "JPEG", quality=90, exif=exif)
    else:
        im.save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    if dirt == "truncated":
        data = data[: len(data) // 3]
    Path(path).write_bytes(data)
    return path


def _plan(cfg: DemoConfig) -> list[tuple]:
    rng = np.random.default_rng(cfg.seed)
    jobs, n = [], 0
    for kind, count in class_counts(cfg.count).items():
        for i in range(count):
            portrait = rng.random() < cfg.portrait_fraction
            w, h = (cfg.height, cfg.width) if portrait else (cfg.width, cfg.height)
            jobs.append([str(cfg.out / kind / f"{kind}_{i:04d}.jpg"), kind, w, h, cfg.seed * 100_003 + n, None])
            n += 1
    # A few dirty files at fixed places, as a real collection has them.
    dirt = ["gray", "gray", "rgba", "truncated", "rotated"]
    for j, d in zip(rng.choice(len(jobs), size=min(len(dirt), len(jobs)), replace=False), dirt):
        jobs[j][5] = d
        if d == "rgba":
            jobs[j][0] = jobs[j][0][:-4] + ".png"
    return [tuple(j) for j in jobs]


def make_demo_data(cfg: DemoConfig) -> dict[str, int]:
    """Write the demo photo collection under cfg.out, one folder per class. Returns the per-class counts."""
    jobs = _plan(cfg)
    for kind in CLASSES:
        (cfg.out / kind).mkdir(parents=True, exist_ok=True)
    workers = usable_cores() if cfg.workers is None else cfg.workers
    with get_context("spawn").Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
        done = pool.imap_unordered(_job, jobs) if pool else map(_job, jobs)
        for _ in tqdm(done, total=len(jobs), desc="demo photos", unit="img"):
            pass
    # An exact copy (deduplicated by the converter) and the clutter every real folder has.
    first = Path(jobs[0][0])
    (first.parent / ("copy_of_" + first.name)).write_bytes(first.read_bytes())
    (cfg.out / "leaf_healthy" / ".DS_Store").write_bytes(b"\0Bud1")
    (cfg.out / "pipe_clean" / "notes.txt").write_text("inspection notes, not a photo\n")
    return class_counts(cfg.count)

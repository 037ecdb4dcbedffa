"""`fastpipe shard`'s settings (kept apart from the driver, as train/config.py and bench/config.py are)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fastpipe.convert import images
from fastpipe.convert.sources import MAX_ROWS
from fastpipe.errors import ConfigError, MissingDependency
from fastpipe.options import SEED_MAX, check, opt, parse_procs, parse_size
from fastpipe.store.location import open_location, place

SPLITS = ("train", "val")
DEFAULT_SHARD_SIZE = 256 * 1024**2
# Readers that divide a split by shard give each DataLoader worker (and each GPU) whole shards: 8 per split serve
# 2 GPUs x 4 workers, and a demo-sized val split would otherwise be one shard, which 2 workers cannot share.
DEFAULT_MIN_SHARDS = 8


class ConvertError(ConfigError):
    """A conversion that can't start: bad arguments, or an OUT that holds other work."""


@dataclass(frozen=True)
class ShardConfig:
    src: Path | str = opt(None, "folder of class folders (optionally train/ and val/), a CSV/TXT list, or either in "
                                "a store (s3://bucket/photos, gs://, az://, hf://datasets/ORG/NAME/photos; "
                                "https://.../list.csv)", positional=True)
    out: Path = opt(None, "output folder, or a URL to upload to (s3://bucket/prefix, gs://, az://, "
                          "hf://datasets/ORG/NAME: one commit)", positional=True)
    short_side: int = opt(320, "stored shorter side in pixels, never upscaled", low=8, high=65535)
    quality: int = opt(90, "JPEG quality of the stored images", low=1, high=100)
    val_fraction: float = opt(0.1, "stratified validation share (ignored when SRC has train/ and val/ folders)",
                              low=0, below=1)
    seed: int = opt(0, "seed for split and shuffle", low=0, high=SEED_MAX)
    max_shard_size: int | None = opt(None, f"shard size limit, e.g. 64MB (default {DEFAULT_SHARD_SIZE // 1024**2}MB; "
                                           f"giving it turns --min-shards off unless given too)", parse=parse_size,
                                     low=64 * 1024, high=1024**4)
    min_shards: int | None = opt(None, f"cut each split into at least N shards of equal sample counts, so that readers "
                                       f"which divide a split by shard (webdataset, Hugging Face, DALI) keep N "
                                       f"workers busy (default {DEFAULT_MIN_SHARDS}, or 1 with --max-shard-size)",
                                 low=1, high=1_000_000)
    max_pixels: int = opt(200_000_000, "refuse larger images (decompression-bomb guard)", low=1)
    max_file_size: int = opt(1024**3, "refuse larger files, e.g. 1GB", parse=parse_size, low=1)
    max_rows: int = opt(MAX_ROWS, "refuse a list (SRC as a CSV/TXT file) of more rows, before any is read: each row is "
                                  "a photo to read (from a store, a request)", low=1)
    workers: int | None = opt(None, "processes: a number (0 = in this process) or auto (every core)",
                              parse=parse_procs, low=0, high=1024)
    overwrite: bool = opt(False, "replace a conversion made with other settings (removes only files fastpipe "
                                 "wrote)")
    part: int = opt(0, "this part's number, for cluster array jobs", low=0)
    parts: int = opt(1, "number of independent parts (then: fastpipe merge)", low=1, high=100_000)
    ray: bool = opt(False, "read, decode, resize and encode the photos as tasks on a Ray cluster ($RAY_ADDRESS or "
                           "--ray-address; else a local one of --workers CPUs); needs fastpipe[ray]")
    ray_address: str | None = opt(None, "the Ray cluster to join: its head node, e.g. 10.0.0.1:6379; implies --ray")
    ray_timeout: float = opt(30.0, "seconds the cluster at --ray-address (or $RAY_ADDRESS) has to answer as Ray "
                                   "before the run stops, naming it", low=1, high=3600)
    near_duplicates: str = opt("group", "near-copies of one picture (resized, recompressed, cropped to 0.85 of its "
                                        "area or more, brightened): group (each group in one split), drop-from-val "
                                        "(with SRC's train/ and val/: the val copies of a group in both removed), "
                                        "drop (one photo per group kept) or off",
                               choices=("group", "drop-from-val", "drop", "off"))
    near_threshold: int = opt(16, "bits of 256 within which two photos' fingerprints are near-copies (calibrated: "
                                  "docs/benchmarks.md)", low=0, high=32)
    on_change: str = opt("reject", "a photo whose bytes changed between planning (hashing) and converting: reject "
                                   "it (recorded as 'changed', the run goes on) or stop the run, naming it",
                         choices=("reject", "stop"))

    def settings(self) -> dict:
        """Everything that changes the output bytes (workers, overwrite and Ray don't)."""
        source = open_location(self.src, what="SRC").identity
        return {"source": source, "short_side": self.short_side,
                "quality": self.quality, "val_fraction": self.val_fraction, "seed": self.seed,
                "max_shard_size": self.shard_bytes, "min_shards": self.shard_count, "max_pixels": self.max_pixels,
                "part": self.part, "parts": self.parts, **self._near_settings()}

    def _near_settings(self) -> dict:
        """The near-copy settings where they are not the defaults: a conversion made before they existed, whose split
        they do not change, stays up to date (one they change differs in its plan anyway)."""
        near = {"near_duplicates": self.near_duplicates, "near_threshold": self.near_threshold}
        return {k: v for k, v in near.items() if v != type(self).__dataclass_fields__[k].default}

    def changes_from(self, saved: dict) -> list[str]:
        """The settings that differ from a conversion's recorded ones (dataset.json's or its journal's), as the
        flags to type and both values: '--quality 70 (OUT has 90)'. SRC's path is not one (plan.fingerprints)."""
        shown = {"max_shard_size": lambda v: f"{v / 1024**2:g}MB" if isinstance(v, int) else repr(v)}
        return [f"--{k.replace('_', '-')} {shown.get(k, str)(v)} (OUT has {shown.get(k, str)(saved[k])})"
                for k, v in self.settings().items() if k != "source" and k in saved and saved[k] != v]

    def image_settings(self) -> images.ImageSettings:
        return images.ImageSettings(self.short_side, self.quality, self.max_pixels)

    def __post_init__(self):
        # Paths given as text (the API, the CLI) become Paths; a URL is checked here, before anything is created.
        object.__setattr__(self, "src", place(self.src, "SRC"))
        object.__setattr__(self, "out", place(self.out, "OUT"))
        check(self)

    def validate(self) -> None:
        """What one setting's range cannot say (each setting's own range is checked when the config is built)."""
        if not self.part < self.parts:
            raise ConvertError(f"--part {self.part} --parts {self.parts}: need 0 <= part < parts")
        if self.uses_ray and importlib.util.find_spec("ray") is None:
            raise MissingDependency("--ray needs Ray here and on every node of the cluster: pip install "
                                    "'fastpipe[ray]' (or pip install ray)")

    @property
    def uses_ray(self) -> bool:
        return self.ray or self.ray_address is not None

    @property
    def shard_bytes(self) -> int:
        return self.max_shard_size or DEFAULT_SHARD_SIZE

    @property
    def shard_count(self) -> int:
        """Shards per split at least (fewer only when a split has fewer samples): --min-shards, or by default 8
        unless the user fixed the shard size, which then alone decides."""
        if self.min_shards is not None:
            return self.min_shards
        return 1 if self.max_shard_size is not None else DEFAULT_MIN_SHARDS

    @property
    def suffix(self) -> str:
        return "" if self.parts == 1 else f".part-{self.part:03d}-of-{self.parts:03d}"

    @property
    def prefixes(self) -> list[str]:
        return [n if self.parts == 1 else f"{n}-{self.part:03d}" for n in SPLITS]

"""The progress journal that makes an interrupted conversion resumable.

One JSON line per finished shard, appended only after the shard's rename: a rerun keeps every shard whose
entry and file agree (size and sha256) and continues from the first sample after it. Because the plan and the
encoder are deterministic, the resumed output is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastpipe.dataset.manifest import ShardInfo, Stats
from fastpipe.dataset.shardformat import sha256_file
from fastpipe.util import parse_json


@dataclass
class SplitProgress:
    """What the finished shards of one split hold, and where the next shard starts."""

    shards: list[ShardInfo] = field(default_factory=list)
    end: int = 0  # index into this part's sample list of the first sample not yet in a shard
    stats: Stats = field(default_factory=Stats.zero)
    counts: list[int] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    done: bool = False

    def add(self, entry: dict) -> None:
        if entry.get("shard"):
            self.shards.append(ShardInfo(**entry["shard"]))
        self.end = entry["end"]
        st = entry["stats"]
        self.stats = self.stats + Stats(st["pixels"], tuple(st["sum"]), tuple(st["sumsq"]))
        self.counts = [a + b for a, b in zip(self.counts, entry["counts"])] if self.counts else entry["counts"]
        self.rejected += entry["rejected"]
        self.done = entry.get("done", False)


def journal_name(suffix: str = "") -> str:
    """The journal's file name in OUT (`suffix`: a part's, e.g. `.part-001-of-004`)."""
    return f".fastpipe-progress{suffix}.jsonl"


def _entries(lines: list[str]):
    """(line, entry) for a journal's lines after the fingerprint; a line cut short by a kill ends them."""
    for line in lines[1:]:
        try:
            yield line, parse_json(line)
        except ValueError:
            return


def journal_shards(text: str) -> list[dict]:
    """The shards a journal lists, in order; a last line still being written is left out."""
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [e["shard"] for _, e in _entries(lines) if e.get("shard")]


class Journal:
    def __init__(self, path: Path, fingerprint: str, settings: dict | None = None):
        # the settings beside the fingerprint: a rerun with others is told which differ, as from dataset.json
        self.path, self.fingerprint, self.settings = Path(path), fingerprint, settings

    def _head(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "settings": self.settings})

    def _read_head(self) -> dict:
        try:
            with open(self.path) as f:
                head = parse_json(f.readline())
        except (OSError, ValueError):
            return {}
        return head if isinstance(head, dict) else {}

    def read_fingerprint(self) -> str | None:
        return self._read_head().get("fingerprint")

    def read_settings(self) -> dict | None:
        """The settings of the conversion this journal records (None in a journal written before they were)."""
        settings = self._read_head().get("settings")
        return settings if isinstance(settings, dict) else None

    def load(self, folder: Path) -> dict[str, SplitProgress]:
        """Valid progress per split; an entry whose shard is missing or altered ends that split's progress."""
        progress: dict[str, SplitProgress] = {}
        if self.read_fingerprint() != self.fingerprint:
            self.path.write_text(self._head() + "\n")
            return progress
        broken: set[str] = set()
        kept = [self._head()]
        for line, entry in _entries(self.path.read_text().splitlines()):  # after a cut line: redone
            split = entry["split"]
            if split in broken or not _shard_intact(folder, entry.get("shard")):
                broken.add(split)
                continue
            progress.setdefault(split, SplitProgress()).add(entry)
            kept.append(line)
        # Rewrite without the dropped lines, so that new entries never follow a half-written one.
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n".join(kept) + "\n")
        os.replace(tmp, self.path)
        return progress

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _shard_intact(folder: Path, shard: dict | None) -> bool:
    if not shard:
        return True
    tar, idx = folder / shard["path"], folder / shard["index"]
    return (tar.is_file() and idx.is_file() and tar.stat().st_size == shard["bytes"]
            and sha256_file(tar) == shard["sha256"])

"""What a conversion tells its user at the end: the files found, written and rejected (by reason), the shards per
split and why, notes, the images that changed colour mode, and the time it took."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fastpipe.convert.config import DEFAULT_MIN_SHARDS

MODE_NAMES = {"L": "grayscale", "LA": "grayscale with transparency (flattened onto white)", "1": "black-and-white",
              "RGBA": "with transparency (flattened onto white)", "P": "palette", "CMYK": "CMYK", "YCbCr": "YCbCr",
              "I;16": "16-bit grayscale", "I": "32-bit grayscale", "F": "floating-point"}


@dataclass
class Summary:
    out: Path
    discovered: int = 0
    written: dict[str, int] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    converted_now: int = 0  # files read and converted (or rejected while converting) by this invocation
    written_now: int = 0  # ... of which written into shards
    modes: Counter = field(default_factory=Counter)  # ... written from another colour mode than RGB
    resumed: int = 0  # samples an earlier, interrupted invocation had converted (in the shards it finished)
    unlabelled: list[str] | None = None  # multi-label data: the planned samples with an empty label set
    up_to_date: bool = False
    ignored: int = 0
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: start (pool), hash, convert, finish
    layout: str = ""  # shards per split and the rule that chose them

    def lines(self) -> list[str]:
        rate = self.converted_now / self.seconds if self.seconds else 0.0
        out = [f"discovered {self.discovered} files -> written "
               + ", ".join(f"{k} {v}" for k, v in self.written.items())
               + f", rejected {sum(self.rejected.values())}"
               + (f" ({self.ignored} hidden/system files ignored)" if self.ignored else "")]
        out += [f"  rejected {n:>5}  {reason}" for reason, n in sorted(self.rejected.items())]
        out += [self.layout] if self.layout else []
        out += [f"note: {n}" for n in self.notes]
        if self.up_to_date:
            out.append(f"{self.out} is already complete for these settings: nothing to do")
        else:
            now = " in this run" if self.resumed else ""  # the figures below are this invocation's only
            out.append(f"{self.converted_now} images processed{now} in {self.seconds:.1f} s ({rate:.1f} img/s): "
                       f"{self.written_now} written, {self.converted_now - self.written_now} rejected while converting"
                       + (f"; {self.resumed} were converted by an earlier run, resumed here" if self.resumed else ""))
            if self.modes:
                out.append(f"converted to RGB{now}: " + ", ".join(f"{n} {MODE_NAMES.get(m, m)}" for m, n in
                                                                 sorted(self.modes.items(), key=lambda x: -x[1])))
        return out


def _mb(size: int) -> str:
    return f"{size / 1024**2:g}MB" if size >= 1024**2 else f"{size / 1024:g}KB"


def describe_layout(cfg, splits: dict) -> tuple[str, str | None]:
    """How many shards each split got (dataset.json's splits) and the rule that chose them; and a note when a split
    has too few for readers that give each worker whole shards, unless the user asked for that."""
    counts = ", ".join(f"{n} {len(sp['shards'])}" for n, sp in splits.items())
    if cfg.shard_count > 1:
        rule = (f"each split cut into at least {cfg.shard_count} (--min-shards), for readers that give each worker "
                f"whole shards; up to {_mb(cfg.shard_bytes)} each")
    else:
        rule = f"up to {_mb(cfg.shard_bytes)} each (--max-shard-size)"
    few = [n for n, sp in splits.items() if len(sp["shards"]) < min(DEFAULT_MIN_SHARDS, sp["samples"])]
    if not few or cfg.min_shards is not None or cfg.parts > 1:
        return f"shards: {counts} ({rule})", None
    return f"shards: {counts} ({rule})", (
        f"{' and '.join(few)} {'has' if len(few) == 1 else 'have'} fewer than {DEFAULT_MIN_SHARDS} shards: webdataset, "
        f"Hugging Face datasets or DALI with several DataLoader workers or GPUs leave some without data (fastpipe's "
        f"own loaders do not mind); --min-shards {DEFAULT_MIN_SHARDS} cuts every split into {DEFAULT_MIN_SHARDS}")


def summarise(summary: Summary, cfg) -> Summary:
    """The counts read back from what the conversion wrote (dataset.json, rejected.jsonl), and its notes."""
    data = json.loads((cfg.out / f"dataset{cfg.suffix}.json").read_text())
    rejected_path = cfg.out / f"rejected{cfg.suffix}.jsonl"
    summary.written = {n: sp["samples"] for n, sp in data["splits"].items()}
    summary.layout, note = describe_layout(cfg, data["splits"])
    summary.notes += [note] if note else []
    rejected = [json.loads(line) for line in rejected_path.read_text().splitlines()] if rejected_path.exists() else []
    summary.rejected = Counter(r["reason"] for r in rejected)
    if summary.unlabelled is not None:  # the samples written, not the rows listed: duplicates and failures left out
        gone = {r["path"] for r in rejected}
        none = sum(p not in gone for p in summary.unlabelled)
        summary.notes.append(f"multi-label: {none} of the images written have none of the {len(data['classes'])} "
                             f"labels (an empty label set)")
    summary.notes += near_note(data.get("outputs", {}).get("near_duplicates"), cfg)
    if len(data["classes"]) < 2:
        summary.notes.append(f"only one class ({data['classes'][0]!r}): a classifier needs at least two. Expected "
                             f"SRC/<class>/<images> with one folder per class, or a list with a label per row")
    if not data["splits"].get("val", {}).get("samples"):
        summary.notes.append("no validation samples: `fastpipe train` will train without evaluating "
                             "(use --val-fraction, or SRC/train + SRC/val folders)")
    return summary


def near_note(near: dict | None, cfg) -> list[str]:
    """What the near-copies found did to the split, in one line (nothing without any)."""
    plain = (f"{near['plain']} photos too plain to fingerprint (no structure at low frequencies, such as an "
             f"evenly lit surface): never grouped") if near and near.get("plain") else ""
    if not near or not near.get("groups"):
        return [f"near-copies: {plain}"] if plain else []
    text = (f"near-copies: {near['groups']} groups of one picture ({near['photos']} photos, listed in "
            f"{near['file']})")
    if near.get("straddling"):
        text += (f"; {near['straddling']} straddle SRC's train/ and val/: validation sees pictures training saw "
                 f"(--near-duplicates drop-from-val removes their val copies)")
    elif cfg.near_duplicates != "drop":
        text += ", each kept in one split"
    if near.get("label_conflicts"):
        text += (f"; {near['label_conflicts']} of them under different labels (a mislabelled copy, or a "
                 f"difference too small for the fingerprint, such as a defect: look at them)")
    return [text + (f"; {plain}" if plain else "")]

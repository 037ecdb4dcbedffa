"""What `fastpipe shard` reports: the counts of a conversion, read back from what it wrote, and its notes."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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
    up_to_date: bool = False
    ignored: int = 0
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: start (pool), hash, convert, finish

    def lines(self) -> list[str]:
        rate = self.converted_now / self.seconds if self.seconds else 0.0
        out = [f"discovered {self.discovered} files -> written "
               + ", ".join(f"{k} {v}" for k, v in self.written.items())
               + f", rejected {sum(self.rejected.values())}"
               + (f" ({self.ignored} hidden/system files ignored)" if self.ignored else "")]
        out += [f"  rejected {n:>5}  {reason}" for reason, n in sorted(self.rejected.items())]
        out += [f"note: {n}" for n in self.notes]
        if self.up_to_date:
            out.append(f"{self.out} is already complete for these settings: nothing to do")
        else:
            out.append(f"{self.converted_now} images processed in {self.seconds:.1f} s ({rate:.1f} img/s): "
                       f"{self.written_now} written, {self.converted_now - self.written_now} rejected while converting")
            if self.modes:
                out.append("converted to RGB: " + ", ".join(f"{n} {MODE_NAMES.get(m, m)}" for m, n in
                                                            sorted(self.modes.items(), key=lambda x: -x[1])))
        return out


def summarise(summary: Summary, manifest_path: Path, rejected_path: Path) -> Summary:
    data = json.loads(manifest_path.read_text())
    summary.written = {n: sp["samples"] for n, sp in data["splits"].items()}
    if rejected_path.exists():
        summary.rejected = Counter(json.loads(line)["reason"] for line in rejected_path.read_text().splitlines())
    if len(data["classes"]) < 2:
        summary.notes.append(f"only one class ({data['classes'][0]!r}): a classifier needs at least two. Expected "
                             f"SRC/<class>/<images> with one folder per class, or a list with a label per row")
    if not data["splits"].get("val", {}).get("samples"):
        summary.notes.append("no validation samples: `fastpipe train` will train without evaluating "
                             "(use --val-fraction, or SRC/train + SRC/val folders)")
    return summary

"""The run folder: the experiment ledger. Every run records its configuration, time, throughput, peak memory
and accuracy; `fastpipe runs` lists them side by side.

    runs/NAME/config.json     every resolved setting, versions, device, loader
    runs/NAME/metrics.jsonl   one line per epoch
    runs/NAME/summary.json    the final figures
    runs/NAME/curves.png      loss / accuracy / throughput per epoch
    runs/NAME/confusion.png   the last validation confusion matrix
    runs/NAME/last.pt         checkpoint (written atomically), for --resume
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from fastpipe.manifest import write_json_atomic


class Run:
    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "last.pt"

    def start(self, config: dict, resume: bool) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        if not resume and (self.path / "metrics.jsonl").exists():
            raise FileExistsError(f"{self.path} already holds a run: use --resume to continue it, "
                                  f"or another --out")
        write_json_atomic(self.path / "config.json", config)

    def metrics(self) -> list[dict]:
        f = self.path / "metrics.jsonl"
        return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []

    def log(self, metrics: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def save(self, state: dict) -> None:
        tmp = self.checkpoint_path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_path)  # a kill mid-write leaves the previous checkpoint intact

    def load(self) -> dict | None:
        if not self.checkpoint_path.exists():
            return None
        return torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)

    def truncate_metrics(self, epochs: int) -> None:
        """On resume: drop epochs logged after the checkpoint (a kill between log and save)."""
        kept = [m for m in self.metrics() if m["epoch"] < epochs]
        (self.path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))

    def finish(self, summary: dict, classes) -> None:
        write_json_atomic(self.path / "summary.json", summary)
        from fastpipe.train.plots import confusion_png, curves_png

        metrics = self.metrics()
        if metrics:
            curves_png(metrics, self.path / "curves.png")
            confusion_png(metrics[-1]["confusion"], classes, self.path / "confusion.png")


def default_run_dir(model: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{model}"


def list_runs(root: Path) -> list[dict]:
    rows = []
    for folder in sorted(p for p in Path(root).iterdir() if (p / "config.json").exists()):
        cfg = json.loads((folder / "config.json").read_text())
        summ = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
        t = cfg.get("train", {})
        rows.append({"run": folder.name, "model": t.get("model"), "backend": t.get("backend"),
                     "amp": t.get("amp"), "batch": t.get("batch_size"), "epochs": summ.get("epochs_done"),
                     "img/s": summ.get("img_per_s"), "wait%": summ.get("data_wait_pct"),
                     "peak MB": summ.get("peak_mem_mb"), "val acc": summ.get("best_val_acc"),
                     "minutes": summ.get("minutes"), "status": summ.get("status", "running?")})
    return rows


def format_runs(rows: list[dict]) -> str:
    if not rows:
        return "no runs"
    cols = list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if v < 10 else f"{v:,.0f}"
        return "-" if v is None else str(v)

    table = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    return "\n".join(lines)

"""The run folder: the experiment ledger. Every run records its configuration, time, throughput, peak memory
and accuracy; `fastpipe runs` lists them side by side.

    runs/NAME/config.json     every resolved setting, versions, device, loader
    runs/NAME/metrics.jsonl   one line per epoch ("kind": "epoch") and every log_every optimizer steps ("step")
    runs/NAME/errors.csv      the most confidently misclassified val samples, with source files (errors.jpg)
    runs/NAME/summary.json    the final figures
    runs/NAME/curves.png      loss / accuracy / throughput per epoch
    runs/NAME/confusion.png   the last validation confusion matrix (single-label)
    runs/NAME/classes.png     per-class accuracy, or per-class AP and F1 for multi-label data
    runs/NAME/last.pt         checkpoint after the last epoch or step saved (written atomically), for --resume
    runs/NAME/best.pt         the weights of the epoch with the best validation accuracy (multi-label: mAP)
    runs/NAME/events.out.tfevents.*  the same scalars and pictures for TensorBoard, when it is installed (board.py)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from fastpipe.errors import ConfigError, DataError
from fastpipe.util import atomic_write_text, parse_json, read_json, write_json_atomic


class RunError(DataError):
    """A run folder whose files are missing, damaged or from another program."""


class Run:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.board = None  # TensorBoard's event files (board.py), when it is installed and the run is started

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "last.pt"

    def refuse_existing(self) -> None:
        if (self.path / "metrics.jsonl").exists() or self.checkpoint_path.exists() or self.best_path.exists():
            raise ConfigError(f"{self.path} already holds a run: add --resume to continue it (its saved "
                                  f"settings are used), or choose another --out")

    def saved_settings(self) -> dict:
        """The training settings the run was started with (config.json's "train")."""
        path = self.path / "config.json"
        if not path.exists():
            raise RunError(f"no run to resume in {self.path} (no config.json): check --out, or start the run "
                           f"without --resume")
        train = _read_json(path).get("train")
        if not isinstance(train, dict):
            raise RunError(f"{path} is damaged or not a fastpipe run's config; start a new run with another --out")
        return train

    def previous_summary(self) -> dict:
        """summary.json as the last invocation left it ({} when missing or damaged)."""
        return _read_json(self.path / "summary.json")

    def start(self, config: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / "config.json", config)

    def metrics(self) -> list[dict]:
        """The logged epochs. A last line cut short by a kill is left out (that epoch is redone on resume); damage
        anywhere else is an error naming the file and line."""
        f = self.path / "metrics.jsonl"
        if not f.exists():
            return []
        lines = f.read_text(errors="replace").splitlines()
        out = []
        for n, line in enumerate(lines, start=1):
            try:
                out.append(parse_json(line))
            except ValueError:
                if n == len(lines):
                    break
                raise RunError(f"{f}, line {n}: not a JSON record; remove the damaged line or start a new run") \
                    from None
        return out

    def epochs(self) -> list[dict]:
        """The per-epoch records (metrics.jsonl also holds a record every log_every optimizer steps)."""
        return [m for m in self.metrics() if isinstance(m, dict) and m.get("kind", "epoch") == "epoch"]

    def log(self, metrics: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.board is not None:
            self.board.log(metrics)

    def open_board(self, purge_step: int | None) -> None:
        """TensorBoard event files from here on (nothing without TensorBoard); `purge_step`: a resumed run's first
        step, from which what earlier invocations logged is dropped, as truncate_metrics drops it."""
        from fastpipe.train.board import open_board

        self.board = open_board(self.path, purge_step)

    def save(self, state: dict) -> None:
        _save(state, self.checkpoint_path)

    @property
    def best_path(self) -> Path:
        return self.path / "best.pt"

    def keep_best(self, m: dict, trainer) -> bool:
        """best.pt: the weights of the epoch with the best validation figure so far (accuracy; mAP for multi-label;
        the earlier of equal ones), with the model card and, for multi-label data, each class's threshold of best F1
        on that validation pass."""
        key = "val_map" if "val_map" in m else "val_acc"
        earlier = [e[key] for e in self.epochs() if key in e and e.get("epoch", -1) < m["epoch"]]
        if key not in m or (earlier and m[key] <= max(earlier)):
            return False
        card = trainer.card and {**trainer.card, "thresholds": m.get("per_class_threshold")}
        state = {"kind": "best", "epoch": m["epoch"], "metric": {key: m[key]}, "inference": card,
                 "model": trainer.bare_model().state_dict(), "normalize": trainer.normalization}
        _save(state, self.best_path)
        return True

    def load(self) -> dict | None:
        """The checkpoint, loaded with weights_only=True: tensors and plain data only, so a crafted file cannot run
        code. A truncated, damaged or foreign file is one clear error naming it."""
        if not self.checkpoint_path.exists():
            return None
        try:
            state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for damage (pickle, zip, EOF): all mean the same here
            raise RunError(f"{self.checkpoint_path} cannot be loaded ({type(e).__name__}: {str(e)[:200]}): a "
                           f"truncated, damaged or foreign checkpoint. Start a new run with another --out") from None
        keys = {"epoch", "model", "optimizer", "scheduler", "scaler"}
        if not isinstance(state, dict) or not keys <= set(state):
            raise RunError(f"{self.checkpoint_path} is not a fastpipe checkpoint (needs {sorted(keys)})")
        return state

    def truncate_metrics(self, epochs: int, global_step: int) -> None:
        """On resume: drop what was logged after the checkpoint (a kill between a log line and the next save), so
        that no epoch or step is recorded twice: epochs from the one resumed, steps after the checkpoint's."""
        kept = [m for m in self.metrics()
                if (m["step"] <= global_step if m.get("kind") == "step" else m["epoch"] < epochs)]
        atomic_write_text(self.path / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in kept))

    def finish(self, summary: dict, classes) -> None:
        write_json_atomic(self.path / "summary.json", summary)
        from fastpipe.train.plots import confusion_png, curves_png, per_class_png

        metrics = self.epochs()
        if metrics:
            curves_png(metrics, self.path / "curves.png")
            if "confusion" in metrics[-1]:
                confusion_png(metrics[-1]["confusion"], classes, self.path / "confusion.png")
            if "per_class_ap" in metrics[-1] or "per_class_acc" in metrics[-1]:
                per_class_png(metrics[-1], classes, self.path / "classes.png")
        if self.board is not None:
            self.board.pictures(self.path)
            self.board.close()
            self.board = None


def _save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill mid-write leaves the previous file intact


def default_run_dir(model: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{model.replace(':', '-')}"  # timm:NAME: no colon


def _read_json(path: Path) -> dict:
    """A JSON object from a run folder, or {} when missing or damaged (a listing must not stop on one bad run)."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


SHOWN = ("model", "backend", "amp", "batch_size")  # settings every listing shows
UNCOMPARED = ("out", "resume", "log_every", "stop_after", "save_every")  # not what tells one run's result from another


def list_runs(root: Path, columns: list[str] | None = None) -> list[dict]:
    """A row per run folder: its settings that differ between the runs listed (or `columns`, settings by name),
    then its results."""
    if not Path(root).is_dir():
        raise RunError(f"{root}: no such folder of runs (runs are written to runs/<time>-<model> or --out)")
    runs = [(folder, _read_json(folder / "summary.json"), _read_json(folder / "config.json").get("train") or {})
            for folder in sorted(p for p in Path(root).iterdir() if (p / "config.json").exists())]
    settings = [{k: v for k, v in t.items() if isinstance(k, str)} for _, _, t in runs]
    differ = columns if columns is not None else [
        k for k in sorted({k for t in settings for k in t} - set(SHOWN) - set(UNCOMPARED))
        if len({json.dumps(t.get(k), sort_keys=True, default=str) for t in settings}) > 1]
    rows = []
    for (folder, summ, t), shown in zip(runs, settings):
        rows.append({"run": folder.name, "model": t.get("model"), "backend": t.get("backend"),
                     "amp": t.get("amp"), "batch": t.get("batch_size"),
                     **{k: _cell(shown.get(k)) for k in differ}, "epochs": summ.get("epochs_done"),
                     "img/s": _speed(summ), "wait%": summ.get("data_wait_pct"),
                     "peak MB": summ.get("peak_mem_mb"),
                     "val acc/mAP": summ.get("best_val_acc") or summ.get("best_val_map"),
                     "minutes": summ.get("minutes"), "status": summ.get("status", "running?")})
    return rows


def _speed(summ: dict):
    """images/s, marked where every epoch was measured while other programs took a fifth of the CPU or more."""
    v = summ.get("img_per_s")
    return f"{v:,.1f} (busy)" if isinstance(v, (int, float)) and summ.get("img_per_s_disturbed") is True else v


def _cell(value) -> str | None:
    """A setting as a short cell (a run folder is anyone's to edit: never longer than 24 characters)."""
    return None if value is None else str(value)[:24]


def format_runs(rows: list[dict]) -> str:
    if not rows:
        return "no runs"
    cols = list(rows[0])

    formats = {"img/s": "{:,.1f}", "wait%": "{:.0f}%", "peak MB": "{:,.0f}", "val acc/mAP": "{:.3f}",
               "minutes": "{:,.1f}"}

    def fmt(c, v):
        if v is None:
            return "-"
        return formats[c].format(v) if c in formats and isinstance(v, (int, float)) else str(v)

    table = [[fmt(c, r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    return "\n".join(lines)

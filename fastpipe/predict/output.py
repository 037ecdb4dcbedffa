"""What `fastpipe predict` writes: one row per photo (CSV or JSON lines; a photo that could not be used is a row
with its reason), and, when SRC gives labels, what validation reports: accuracy or mAP, per-class figures, the
confusion matrix and the most confident mistakes as pictures, beside the output file."""

from __future__ import annotations

import csv
import heapq
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastpipe.errors import ConfigError

SHOWN_ERRORS = 32


NEAR_TRAINING = "a near-copy of the training photo"  # an ok row's detail: its score says what training saw


@dataclass
class Row:
    path: str
    label: str | None  # from SRC (a label set: names joined by ';'), None when it gives none
    scores: list[float] | None  # probabilities per class; None for a photo that could not be used
    status: str = "ok"  # or the rejection's reason
    detail: str = ""
    image: bytes | None = field(default=None, repr=False)  # the prepared photo (for the sheet of mistakes)


class Output:
    """Writes rows as they come (to a temporary file, renamed into place at the end) and keeps what the report
    needs: each labelled photo's scores, and the few most confident mistakes' images."""

    def __init__(self, path: Path, fmt: str, model, top_k: int):
        self.path, self.fmt, self.model, self.top_k = path, fmt, model, min(top_k, len(model.classes))
        self.classes, self.index = model.classes, {c: k for k, c in enumerate(model.classes)}
        self.count = self.rejected = self.unknown = self.near_training = 0
        self.scored: list[tuple[object, list[float]]] = []  # (label index or multi-hot, scores)
        self.mistakes: list[tuple[float, int, dict, bytes]] = []  # a min-heap of the most confident
        if path.is_symlink() or path.is_dir():
            raise ConfigError(f"--out {path}: a link or a folder; give a new file name (it is replaced, not written "
                              f"through)")
        path.parent.mkdir(parents=True, exist_ok=True)

    def __enter__(self):
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        self.fh = os.fdopen(fd, "w", encoding="utf-8", newline="")
        self.csv = csv.writer(self.fh) if self.fmt == "csv" else None
        if self.csv:
            self.csv.writerow(self._header())
        return self

    def __exit__(self, kind, value, tb):
        self.fh.close()
        if kind is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)

    def _header(self) -> list[str]:
        if self.model.multilabel:
            return ["path", "predicted", "label", "status", "detail", *(f"score:{c}" for c in self.classes)]
        return ["path", "predicted", "probability", "top_k", "label", "status", "detail"]

    def write(self, rows: list[Row]) -> None:
        for r in rows:
            self.count += 1
            self.rejected += r.scores is None
            self.near_training += r.detail.startswith(NEAR_TRAINING)
            record = self._record(r)
            if self.csv:
                self.csv.writerow([_inert(c) for c in self._cells(record)])
            else:
                self.fh.write(json.dumps(record) + "\n")
            if r.scores is not None and r.label is not None:
                self._keep(r, record)

    def _record(self, r: Row) -> dict:
        base = {"path": r.path, "label": r.label, "status": r.status, "detail": r.detail}
        if r.scores is None:
            return {**base, "predicted": None}
        if self.model.multilabel:
            t = self.model.thresholds()
            picked = [c for c, s, th in zip(self.classes, r.scores, t) if s >= th]
            return {**base, "predicted": picked, "scores": dict(zip(self.classes, r.scores))}
        order = sorted(range(len(r.scores)), key=lambda k: -r.scores[k])[: self.top_k]
        return {**base, "predicted": self.classes[order[0]], "probability": r.scores[order[0]],
                "top_k": [[self.classes[k], r.scores[k]] for k in order]}

    def _cells(self, rec: dict) -> list:
        label = rec["label"] or ""
        if self.model.multilabel:
            scores = rec.get("scores") or {}
            return [rec["path"], ";".join(rec["predicted"] or []), label, rec["status"], rec["detail"],
                    *(f"{scores[c]:.6f}" if c in scores else "" for c in self.classes)]
        if rec["predicted"] is None:
            return [rec["path"], "", "", "", label, rec["status"], rec["detail"]]
        top = ";".join(f"{c}={p:.6f}" for c, p in rec["top_k"])
        return [rec["path"], rec["predicted"], f"{rec['probability']:.6f}", top, label, rec["status"], rec["detail"]]

    def _keep(self, r: Row, rec: dict) -> None:
        """A labelled photo's scores for the report, and its image if it is among the most confident mistakes."""
        if self.model.multilabel:
            names = [n for n in r.label.split(";") if n]
            if any(n not in self.index for n in names):
                self.unknown += 1
                return
            target = [float(c in names) for c in self.classes]
            self.scored.append((target, r.scores))
            wrong = [abs(s - t) for s, t, th in zip(r.scores, target, self.model.thresholds()) if (s >= th) != t]
            if wrong:
                k = max(range(len(target)), key=lambda j: abs(r.scores[j] - target[j]))
                self._mistake(max(wrong), {"label": target, "predicted": k}, r)
            return
        if r.label not in self.index:
            self.unknown += 1
            return
        y = self.index[r.label]
        self.scored.append((y, r.scores))
        if rec["predicted"] != r.label:
            self._mistake(rec["probability"], {"label": y, "predicted": self.index[rec["predicted"]]}, r)

    def _mistake(self, confidence: float, e: dict, r: Row) -> None:
        entry = (confidence, self.count, {**e, "confidence": confidence, "source": r.path, "sample": r.path},
                 r.image or b"")
        (heapq.heappush if len(self.mistakes) < SHOWN_ERRORS else heapq.heappushpop)(self.mistakes, entry)

    def finish(self) -> list[str]:
        lines = [f"wrote {self.path} ({self.count} photos: {self.count - self.rejected} predicted, {self.rejected} "
                 f"could not be used)"]
        if self.unknown:
            lines.append(f"note: {self.unknown} photos are labelled with classes the model does not know: predicted, "
                         f"not scored")
        if self.near_training:
            lines.append(f"note: {self.near_training} photos are near-copies of photos this run trained on (the "
                         f"detail column names each): their scores say what training saw, not how the model does on "
                         f"new photos")
        if self.scored:
            from fastpipe.predict.report import report

            lines += report(self, self.path)
        return lines

    def errors(self) -> list[tuple[dict, bytes]]:
        return [(e, image) for _, _, e, image in sorted(self.mistakes, key=lambda m: (-m[0], m[1]))]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        labels, scores = zip(*self.scored)
        return torch.tensor(labels), torch.tensor(scores, dtype=torch.float32)


def _inert(cell):
    """A text cell that a spreadsheet would run as a formula (a photo's name is anyone's to choose) starts with a
    quote, as spreadsheets themselves write it; numbers and JSON lines are left as they are."""
    return f"'{cell}" if isinstance(cell, str) and cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


__all__ = ["NEAR_TRAINING", "Output", "Row"]

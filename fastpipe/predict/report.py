"""When the photos predicted carry labels: the figures validation reports, for these photos. Written beside the
predictions as OUT-STEM.report.json, .confusion.png (single-label), .classes.png and .errors.jpg (the most
confident mistakes, each with its photo)."""

from __future__ import annotations

from pathlib import Path

import torch

from fastpipe.util import write_json_atomic


def _beside(out: Path, what: str) -> Path:
    return out.with_name(f"{out.stem}.{what}")


def report(output, out: Path) -> list[str]:
    labels, scores = output.tensors()
    classes = output.classes
    figures = _multilabel(labels, scores, output.model.thresholds()) if output.model.multilabel else \
        _single(labels, scores, len(classes))
    errors = output.errors()
    write_json_atomic(_beside(out, "report.json"), {
        **_named(figures), "photos": len(labels), "classes": classes, "model": output.model.source,
        "errors": [{k: e[k] for k in ("source", "label", "predicted", "confidence")} for e, _ in errors]})
    from fastpipe.train.errors import error_sheet
    from fastpipe.train.plots import confusion_png, per_class_png

    pictures = [_beside(out, "classes.png")]
    per_class_png(figures, classes, pictures[0], when="predictions", images="photos")
    if "confusion" in figures:
        pictures.append(_beside(out, "confusion.png"))
        confusion_png(figures["confusion"], classes, pictures[-1], title="predictions against SRC's labels")
    if errors:
        images = {id(e): image for e, image in errors}
        pictures.append(_beside(out, "errors.jpg"))
        error_sheet(pictures[-1], [e for e, _ in errors], lambda e: images[id(e)], classes)
    return [_headline(figures, len(labels), classes), f"report: {_beside(out, 'report.json')}; pictures: "
            + ", ".join(p.name for p in pictures)]


def _named(figures: dict) -> dict:
    """The figures named for the photos predicted, not for a validation split: accuracy, map, exact_match..."""
    return {("accuracy" if k == "val_acc" else k.removeprefix("val_")): v for k, v in figures.items()}


def _single(labels: torch.Tensor, scores: torch.Tensor, k: int) -> dict:
    pred = scores.argmax(1)
    cm = torch.bincount(labels * k + pred, minlength=k * k).view(k, k)
    per_class = (cm.diag().double() / cm.sum(1).clamp(min=1).double()).tolist()
    return {"val_acc": float(cm.diag().sum()) / max(len(labels), 1), "per_class_acc": per_class,
            "confusion": cm.tolist()}


def _multilabel(targets: torch.Tensor, scores: torch.Tensor, thresholds: list[float]) -> dict:
    from fastpipe.train.metrics import multilabel_metrics

    figures = multilabel_metrics(scores, targets, threshold=0.5)
    picked = scores >= torch.tensor(thresholds)
    tp = (picked & targets.bool()).sum(0).double()
    precision, recall = tp / picked.sum(0).clamp(min=1), tp / targets.sum(0).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    return {**figures, "val_exact_match": float((picked == targets.bool()).all(1).float().mean()),
            "per_class_precision": precision.tolist(), "per_class_recall": recall.tolist(),
            "per_class_f1": f1.tolist(), "val_macro_f1": float(f1.mean()), "threshold": "per class",
            "thresholds": thresholds, "per_class_positives": [int(x) for x in targets.sum(0).tolist()]}


def _headline(f: dict, n: int, classes) -> str:
    if "val_acc" in f:
        worst = min(range(len(classes)), key=lambda k: f["per_class_acc"][k])
        return (f"accuracy {f['val_acc']:.4f} on {n} labelled photos (lowest class: {classes[worst]} "
                f"{f['per_class_acc'][worst]:.3f})")
    return (f"mAP {f['val_map']:.4f}, exact match {f['val_exact_match']:.4f} (each class at its threshold) on {n} "
            f"labelled photos")

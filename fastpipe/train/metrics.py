"""Multi-label validation figures: per-class average precision, precision, recall and F1 at a threshold chosen on
val, mean AP and exact-match accuracy. Computed from all val scores at once (val is small), no sklearn."""

from __future__ import annotations

import torch

THRESHOLDS = torch.arange(0.05, 0.96, 0.05)


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per class (columns): the mean of the precision at each positive, ranked by score (sklearn's definition);
    NaN for a class with no positive in val."""
    order = scores.argsort(0, descending=True)
    hits = targets.gather(0, order)
    precision = hits.cumsum(0) / torch.arange(1, len(scores) + 1, device=scores.device).unsqueeze(1)
    positives = hits.sum(0)
    ap = (precision * hits).sum(0) / positives.clamp(min=1)
    return torch.where(positives > 0, ap, torch.full_like(ap, float("nan")))


def _prf(pred: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tp = (pred * targets).sum(0)
    precision = tp / pred.sum(0).clamp(min=1)
    recall = tp / targets.sum(0).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    return precision, recall, f1


def best_threshold(probs: torch.Tensor, targets: torch.Tensor) -> float:
    """The one threshold (0.05 .. 0.95) with the best macro F1 on these scores."""
    scores = [_prf((probs >= t).float(), targets)[2].mean().item() for t in THRESHOLDS.tolist()]
    return round(THRESHOLDS[int(torch.tensor(scores).argmax())].item(), 2)


def class_thresholds(probs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Each class's threshold (0.05 .. 0.95) with its best F1 on these scores; 0.5 for a class with no positive
    here (no score can tell its best). What `fastpipe predict` decides each class with."""
    f1 = torch.stack([_prf((probs >= t).float(), targets)[2] for t in THRESHOLDS.tolist()])  # (T, K)
    best = THRESHOLDS[f1.argmax(0)]  # the first (lowest) of equal F1s
    # the grid's own float32 values, not rounded: a score is compared with what validation compared it with
    return [t if n > 0 else 0.5 for t, n in zip(best.tolist(), targets.sum(0).tolist())]


def multilabel_metrics(probs: torch.Tensor, targets: torch.Tensor, threshold: float | None = None) -> dict:
    """probs, targets: (N, K) on the CPU. With threshold None it is chosen here (on these val scores)."""
    threshold = best_threshold(probs, targets) if threshold is None else threshold
    pred = (probs >= threshold).float()
    precision, recall, f1 = _prf(pred, targets)
    ap = average_precision(probs, targets)
    seen = ~ap.isnan()
    return {"val_map": float(ap[seen].mean()) if seen.any() else 0.0,
            "val_exact_match": float((pred == targets).all(1).float().mean()) if len(targets) else 0.0,
            "per_class_positives": [int(n) for n in targets.sum(0).tolist()],  # how many val images show it
            "val_macro_f1": float(f1.mean()), "threshold": threshold,
            "per_class_ap": [None if x != x else round(x, 4) for x in ap.tolist()],
            "per_class_precision": precision.tolist(), "per_class_recall": recall.tolist(),
            "per_class_f1": f1.tolist(), "per_class_threshold": class_thresholds(probs, targets)}

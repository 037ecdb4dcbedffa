"""The validation pass: accuracy, loss, per-class figures and confusion (multi-label: mAP, per-class AP and F1,
the thresholds that give each class its best F1), and the most confidently misclassified samples. All ranks take
part; the figures are reduced over them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def evaluate(trainer, loader, k: int, errors: int = 32) -> dict:
    """Accuracy, loss, per-class accuracy and confusion (multi-label: mAP, per-class AP/precision/recall/F1
    and exact match); with a loader that yields keys, also the `errors` most confidently misclassified samples
    (what to look at first when hunting label mix-ups)."""
    trainer.model.eval()
    confusion = torch.zeros(k * k, dtype=torch.int64, device=trainer.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    candidates, scores = [], []  # worst of each batch; multi-label: every (probs, targets) for the figures
    for batch in loader:
        x, y = batch[0], batch[1]
        if len(y) == 0:
            continue
        with trainer.autocast():
            out = trainer.model(x).float()
        if y.is_floating_point():  # multi-label: multi-hot targets
            loss_sum += nn.functional.binary_cross_entropy_with_logits(out, y, reduction="sum").double() / k
            probs = out.sigmoid()
            scores.append((probs, y))
            conf, pred = ((probs - y).abs() * ((probs >= 0.5) != y.bool())).max(1)
        else:
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").double()
            conf, pred = out.softmax(1).max(1)
            confusion += torch.bincount(y * k + pred, minlength=k * k)
            conf = torch.where(pred != y, conf, -1.0)
        if len(batch) == 3:  # on the device, no sync: the top few of this batch
            top = torch.topk(torch.where(conf > 0, conf, -1.0), min(errors, len(y)))
            candidates.append((top.values, top.indices, pred[top.indices], y[top.indices], batch[2]))
    result = _figures(trainer, confusion, loss_sum, scores, k)
    if candidates:
        result["errors"] = _worst(trainer, candidates, errors)
    return result

def _figures(trainer, confusion, loss_sum, scores, k: int) -> dict:
    if trainer.dist.world > 1:
        dist.all_reduce(confusion)
        dist.all_reduce(loss_sum)
    if scores:
        from fastpipe.train.metrics import multilabel_metrics

        probs, targets = (torch.cat(t) for t in zip(*scores))
        if trainer.dist.world > 1:  # every rank's scores, for one threshold and AP over the whole val set
            parts = [None] * trainer.dist.world
            dist.all_gather_object(parts, (probs.cpu(), targets.cpu()))
            probs, targets = torch.cat([p for p, _ in parts]), torch.cat([t for _, t in parts])
        total = len(targets)
        return {"val_loss": float(loss_sum) / max(total, 1), "val_samples": total,
                **multilabel_metrics(probs.cpu(), targets.cpu())}
    cm = confusion.view(k, k).cpu()  # host sync, once per evaluation
    total = int(cm.sum())
    per_class = (cm.diag().double() / cm.sum(1).clamp(min=1).double()).tolist()
    return {"val_acc": float(cm.diag().sum()) / max(total, 1), "val_loss": float(loss_sum) / max(total, 1),
            "per_class_acc": per_class, "confusion": cm.tolist(), "val_samples": total}

def _worst(trainer, candidates: list, errors: int) -> list[dict]:
    found = [{"confidence": c, "predicted": p, "label": t, "key": str(keys[i]), "source": keys[i].source,
              "shard": keys[i].shard, "sample": keys[i].key, "id": keys[i].id}
             for vals, idx, pred, lab, keys in candidates
             for c, i, p, t in zip(vals.tolist(), idx.tolist(), pred.tolist(), lab.tolist()) if c > 0]
    if trainer.dist.world > 1:
        everyone = [None] * trainer.dist.world
        dist.all_gather_object(everyone, found)
        found = [e for part in everyone for e in part]
    return sorted(found, key=lambda e: -e["confidence"])[:errors]


"""Training curves and the confusion matrix as PNGs (people would rather look than read)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from fastpipe.train import speed
from fastpipe.util import atomic_write_bytes


def _figure(*size):
    """A figure drawn without pyplot, so the caller's matplotlib backend and state stay untouched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: Path, dpi: int = 100) -> None:
    """A figure as PNG, written atomically: a link planted under the picture's name is replaced, not written
    through, and a reader never sees half a picture."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(path, buf.getvalue())


def curves_png(metrics: list[dict], path: Path) -> None:
    save(curves_figure(metrics), path)


def curves_figure(metrics: list[dict]):
    ep = [m["epoch"] + 1 for m in metrics]
    fig = _figure(13, 3.6)
    axes = fig.subplots(1, 3)
    axes[0].plot(ep, [m["train_loss"] for m in metrics], "o-", label="train")
    val = [m for m in metrics if "val_loss" in m]
    score = "val_map" if val and "val_map" in val[-1] else "val_acc"
    if val:
        axes[0].plot([m["epoch"] + 1 for m in val], [m["val_loss"] for m in val], "o-", label="val")
        axes[1].plot([m["epoch"] + 1 for m in val], [m[score] for m in val], "o-", color="tab:green")
    axes[0].set_title("loss")
    axes[0].set_ylabel("loss (mean per image)")
    axes[0].legend()
    axes[1].set_ylim(0, 1)
    axes[1].set_ylabel("mAP (0-1)" if score == "val_map" else "accuracy (0-1)")
    title = "validation mAP" if score == "val_map" else "validation accuracy"
    axes[1].set_title(title if val else f"{title} (no val split)")
    axes[2].plot(ep, [m["img_per_s"] for m in metrics], "o-", color="tab:purple", label="images/s")
    busy = [(e, m["img_per_s"]) for e, m in zip(ep, metrics) if speed.busy(m)]
    if busy:  # hollow: other programs took a fifth of the CPU or more, not the run's own speed
        axes[2].plot(*zip(*busy), "o", mfc="white", color="tab:purple", label="other programs busy")
    ax2 = axes[2].twinx()
    ax2.bar(ep, [100 * m["data_wait"] for m in metrics], alpha=0.25, color="tab:red", label="data wait %")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("data wait (% of each step)")
    axes[2].set_ylabel("images / s")
    axes[2].set_ylim(0, 1.1 * max([m["img_per_s"] for m in metrics] + [1e-9]))  # from 0: 2 % is not a jump
    axes[2].set_title("throughput (line) and data wait % (bars)")
    for a in axes:
        a.set_xlabel("epoch")
    fig.tight_layout()
    return fig


def confusion_png(confusion: list[list[int]], classes, path: Path, title: str = "validation confusion") -> None:
    cm = np.array(confusion)
    k = len(classes)
    fig = _figure(1.0 + 0.7 * k, 0.8 + 0.6 * k)
    ax = fig.add_subplot()
    rows = cm.sum(1, keepdims=True).clip(min=1)
    ax.imshow(cm / rows, cmap="Blues", vmin=0, vmax=1)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=8,
                    color="white" if cm[i, j] / rows[i, 0] > 0.5 else "black")
    ax.set_xticks(range(k), classes, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(k), classes, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"{title} (counts; colour = row share)", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def class_counts(last: dict) -> list[int] | None:
    """Each class's val images (single-label: the confusion's rows) or positives (multi-label), when recorded."""
    if "confusion" in last:
        return [int(sum(row)) for row in last["confusion"]]
    return last.get("per_class_positives")


def per_class_png(last: dict, classes, path: Path, when: str = "last epoch", images: str = "val images") -> None:
    save(per_class_figure(last, classes, when, images), path)


def per_class_figure(last: dict, classes, when: str = "last epoch", images: str = "val images"):
    """The last evaluation per class: accuracy (single-label) or AP and F1 (multi-label), rarest problems visible,
    each class with its number of val images under its name (a score of 1 or 2 images says little)."""
    k = len(classes)
    fig = _figure(max(5.0, 0.55 * k + 2), 3.8)
    ax = fig.add_subplot()
    x = np.arange(k)
    counts = class_counts(last)
    if "per_class_ap" in last:
        ap = [v if v is not None else 0.0 for v in last["per_class_ap"]]
        for bars in (ax.bar(x - 0.2, ap, 0.4, label="average precision", color="tab:blue"),
                     ax.bar(x + 0.2, last["per_class_f1"], 0.4, label=f"F1 at threshold {last['threshold']}",
                            color="tab:orange")):
            ax.bar_label(bars, fmt="%.2f", fontsize=6)  # a class at 0 shows its 0.00, not an empty slot
        ax.set_ylabel("score (0-1)")
        ax.legend(fontsize=8)
        ax.set_title(f"per class, {when}: mAP {last['val_map']:.3f}" + (f"; n = {images} with the label"
                                                                        if counts else ""), fontsize=9)
    else:
        bars = ax.bar(x, last["per_class_acc"], 0.6, color="tab:green")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)  # a class at 0 shows its 0.00, not an empty slot
        ax.set_title(f"per-class accuracy, {when} ({last['val_acc']:.3f} overall); n = {images}", fontsize=9)
        ax.set_ylabel("accuracy (0-1)")
    ax.set_ylim(0, 1.08)
    names = [f"{c} (n={n})" for c, n in zip(classes, counts)] if counts else list(classes)
    ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    return fig

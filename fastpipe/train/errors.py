"""The most confidently misclassified validation samples, with their source files: errors.csv and errors.jpg in
the run folder. A label mix-up (a 'rust' photo filed as 'healthy') shows up here at the top, in a minute."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from PIL import Image, ImageDraw

from fastpipe.util import atomic_write_bytes, atomic_write_text

CELL, CAPTION, COLS = 200, 34, 6


def _names(e: dict, classes) -> tuple[str, str]:
    """(true label, prediction) as text. Multi-label: the true label set, and the one label most confidently
    wrong, '+name' when predicted but absent, '-name' when present but missed."""
    if isinstance(e["label"], list):
        true = [classes[k] for k, v in enumerate(e["label"]) if v > 0.5]
        k = e["predicted"]
        return ";".join(true) or "(none)", ("-" if e["label"][k] > 0.5 else "+") + classes[k]
    return classes[e["label"]], classes[e["predicted"]]


def write_errors(run: Path, errors: list[dict], shards, classes) -> str | None:
    """errors: dicts with confidence, predicted, label, key, source, id (Trainer.evaluate). With none, errors.csv
    lists none, an earlier errors.jpg is removed, and the line to say so is returned."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["rank", "confidence", "label", "predicted", "source", "shard", "sample"])
    for r, e in enumerate(errors, 1):
        w.writerow([r, f"{e['confidence']:.4f}", *_names(e, classes), e["source"] or "", e["shard"], e["sample"]])
    atomic_write_text(run / "errors.csv", buf.getvalue())
    if not errors:
        (run / "errors.jpg").unlink(missing_ok=True)  # an earlier epoch's or run's: not this one's
        return (f"no validation mistakes in the last epoch: {run / 'errors.csv'} lists none, and there is no "
                f"errors.jpg")
    if shards is not None:
        error_sheet(run / "errors.jpg", errors, lambda e: shards.sample(e["id"]).image, classes)
    return None


def _clip(text: str, n: int, keep_end: bool = False) -> str:
    """At most n characters, an ellipsis where text was cut (the end of a path is what tells files apart)."""
    if len(text) <= n:
        return text
    return "…" + text[-(n - 1):] if keep_end else text[: n - 1] + "…"


def error_sheet(path: Path, errors: list[dict], image_of, classes) -> None:
    """The errors as a contact sheet: each image (`image_of(error)`: its stored JPEG) with its true and predicted
    class, the confidence and the source file."""
    cols = min(COLS, len(errors))  # a few mistakes: a sheet as wide as they are, not a mostly empty one
    rows = -(-len(errors) // cols)
    sheet = Image.new("RGB", (cols * CELL, rows * (CELL + CAPTION)), (30, 30, 30))
    draw = ImageDraw.Draw(sheet)
    for n, e in enumerate(errors):
        x, y = (n % cols) * CELL, (n // cols) * (CELL + CAPTION)
        try:
            im = Image.open(io.BytesIO(image_of(e))).convert("RGB")
            im.thumbnail((CELL, CELL))
            sheet.paste(im, (x + (CELL - im.width) // 2, y + (CELL - im.height) // 2))
        except (OSError, ValueError):
            pass  # an undecodable image still gets its caption
        true, predicted = _names(e, classes)
        draw.text((x + 4, y + CELL + 2), f"{_clip(true, 14)} -> {_clip(predicted, 14)}", fill=(255, 200, 120))
        draw.text((x + 4, y + CELL + 17), f"{e['confidence']:.2f} {_clip(e['source'] or e['sample'], 22, True)}",
                  fill=(220, 220, 220))
    out = io.BytesIO()
    sheet.save(out, "JPEG", quality=85)
    atomic_write_bytes(path, out.getvalue())

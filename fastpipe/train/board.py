"""TensorBoard event files in the run folder, so that `tensorboard --logdir runs/` shows every run: the scalars
metrics.jsonl holds (loss, learning rate, images/s, the share of time waiting for data, accuracy or mAP, peak memory)
and the run's pictures (curves, confusion, per class). Written only when the `tensorboard` package is installed
(`pip install -e '.[tensorboard]'`); without it nothing changes.

Every scalar and picture is at its optimizer step (the run's global step), so the charts of an epoch line up with its
steps. A resumed run opens its event file with TensorBoard's purge marker at the checkpoint's step + 1: what an
earlier invocation logged after its last checkpoint (the steps the resumed run trains again) is dropped, as
metrics.jsonl drops it, instead of drawn twice over.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from fastpipe.errors import FastpipeWarning

STEP_TAGS = {"loss": "train/loss", "lr": "train/lr"}  # every --log-every steps: the epoch's mean loss so far
EPOCH_TAGS = {"train_loss": "epoch/train_loss", "val_loss": "epoch/val_loss", "val_acc": "epoch/val_accuracy",
              "val_map": "epoch/val_mAP", "val_exact_match": "epoch/val_exact_match",
              "val_macro_f1": "epoch/val_macro_F1", "img_per_s": "epoch/images_per_s",
              "data_wait": "epoch/data_wait_share", "peak_mem_mb": "epoch/peak_memory_MB", "lr": "epoch/lr"}
PICTURES = {"curves.png": "curves", "confusion.png": "confusion", "classes.png": "per_class"}
PREFIX = "events.out.tfevents."  # then the second the file was opened, as 10 digits, and the host


def open_board(folder: Path, purge_step: int | None) -> Board | None:
    """A writer of event files into `folder`, or None without TensorBoard. `purge_step`: a resumed run's first
    step (what was logged from there on is dropped)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    except Exception as e:  # an installed but broken TensorBoard (say, a protobuf it cannot use): train anyway
        warnings.warn(f"TensorBoard is installed but does not load ({type(e).__name__}: {e}): this run writes no "
                      f"event files", FastpipeWarning, stacklevel=2)
        return None
    _after_earlier_files(folder)
    return Board(SummaryWriter(str(folder), purge_step=purge_step, flush_secs=30))


def _after_earlier_files(folder: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with the second it was opened
    (events.out.tfevents.SECOND.host...): a resumed run's file must sort after the earlier ones, or its purge marker
    would come before the steps it drops. Two invocations within one second: wait for the next second, by this
    clock (a second at most). A name that sorts after this run's in any other way (a file stamped in the future, a
    name that is no stamp) is never waited for: no wait would put this run's file after it; a warning names it."""
    second = int(time.time())
    mine = f"{PREFIX}{second:010d}."  # the start of the name SummaryWriter gives a file it opens now
    later = sorted(p.name for p in folder.glob(PREFIX + "*") if p.name >= mine)
    while any(n.startswith(mine) for n in later) and int(time.time()) <= second:
        time.sleep(0.05)
    after = [n for n in later if not n.startswith(mine)]
    if after:
        warnings.warn(f"{folder / after[0]}" + (f" (and {len(after) - 1} more)" if len(after) > 1 else "") +
                      " sorts after this run's TensorBoard event file, which TensorBoard reads in name order: what "
                      "it holds is drawn over the steps logged now (not a file of this clock's time: stamped in "
                      "the future, or not by TensorBoard); move it out of the run folder", FastpipeWarning,
                      stacklevel=3)


class Board:
    def __init__(self, writer):
        self.writer, self.step = writer, 0

    def log(self, record: dict) -> None:
        """A metrics.jsonl record: a step record at its step, an epoch record at the step its epoch ended on."""
        step = record.get("step") if record.get("kind") == "step" else record.get("global_step")
        if step is None:
            return
        self.step = max(self.step, step)
        for key, tag in (STEP_TAGS if record.get("kind") == "step" else EPOCH_TAGS).items():
            if isinstance(record.get(key), (int, float)):
                self.writer.add_scalar(tag, record[key], step)
        for stage, ms in (record.get("loader_ms_per_image") or {}).items():  # where the loader's time goes
            self.writer.add_scalar(f"loader/{stage}_ms_per_image", ms, step)

    def pictures(self, folder: Path) -> None:
        """The run's figures as they stand, at the last step logged."""
        import numpy as np
        from PIL import Image

        for name, tag in PICTURES.items():
            if (folder / name).exists():
                with Image.open(folder / name) as im:
                    self.writer.add_image(tag, np.asarray(im.convert("RGB")), self.step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()

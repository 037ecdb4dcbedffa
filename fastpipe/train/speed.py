"""An epoch's speed, and whether it is the run's own: measured while other programs took a fifth of the machine's
CPU or more, it is said to be disturbed (as `fastpipe bench` says of its rows) and left out of the run's figure."""

from __future__ import annotations

from fastpipe.loaders.stats import BUSY_SHARE


def busy(m: dict) -> bool:
    share = m.get("others_cpu_pct")  # a run folder is anyone's to edit: a number or nothing
    return isinstance(share, (int, float)) and not isinstance(share, bool) and share >= 100 * BUSY_SHARE


def disturbed(m: dict) -> str:
    """Said beside an epoch's speed when other programs took a fifth of the CPU or more meanwhile (as bench does)."""
    return f" (other programs took {m['others_cpu_pct']:.0f}% of the CPU: not this run's speed)" if busy(m) else ""


def run_speed(ms: list[dict]) -> dict:
    """The run's images/s: the mean of its epochs measured without other programs taking a fifth of the CPU, or of
    every epoch, said to be disturbed, when none was."""
    quiet = [m for m in ms if not busy(m)]
    of = quiet or ms
    return {"img_per_s": sum(m["img_per_s"] for m in of) / len(of) if of else None,
            "disturbed_epochs": len(ms) - len(quiet), "img_per_s_disturbed": bool(ms) and not quiet}

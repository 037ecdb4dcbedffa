"""What `fastpipe.watch` says: the summary of a watched loop (a dict) and its few lines, in `fastpipe bench`'s words
and thresholds (verdict.py)."""

from __future__ import annotations

from fastpipe.bench.verdict import MIN_STEPS
from fastpipe.loaders.stats import wait_verdict

ADVICE = {
    "read": "reading dominates: keep the shards on a local disk or give the node cache a fast one (cache_dir=), and "
            "more workers to overlap fetching",
    "decode": "decoding dominates: more workers (num_workers=), GPU decoding on CUDA (backend='dali' or 'nvjpeg'), "
              "or smaller stored photos (fastpipe shard --short-side about 1.15 x the image size)",
    "headers": "reading JPEG headers dominates: more workers (num_workers=)",
    "assemble": "finishing batches dominates: samples that fail are being replaced (fastpipe inspect --verify "
                "names them)",
    "device": "the training process's own part dominates (the copy to the device, normalisation, device "
              "augmentation): on a CPU it competes with the step; normalize=False hands uint8 batches to a model "
              "that normalises itself",
}
DEVICE_ADVICE = ("the step sets the pace: mixed precision, channels_last, a larger batch if memory allows "
                 "(fastpipe memory), torch.compile")
PLAIN_ADVICE = ("more DataLoader workers and pin_memory=True; fastpipe's loader times its stages and says which "
                "one to change")


WORKER_STAGES = ("read", "decode", "headers", "assemble")  # made in the loader's workers, in parallel


def summary(w) -> dict:
    """The summary of a watch.Watch."""
    wait, step, n = w.steady
    stages = w.stages()
    out = {"steps": w.steps, "warmup_steps": min(w.steps, w.warmup), "images": w.images,
           "first_steps": _times(*w.first, min(w.steps, w.warmup)), "steady": _times(wait, step, n),
           "stages_ms_per_image": None if stages is None else {k: 1000 * v for k, v in stages.items()},
           "leading_stage": next(iter(stages), None) if stages else None,
           "device_ms_per_step": 1000 * w.device_s / w.device_steps if w.device_steps else None,
           "memory": _memory(w), "verdict": None, "verdict_text": None, "headroom": None, "advice": []}
    if n < MIN_STEPS:
        out["verdict_text"] = (f"no verdict yet: {n} step(s) after the {w.warmup} of warm-up, {MIN_STEPS} needed "
                               f"(watch(..., warmup=) sets the warm-up)")
        return out
    share = wait / max(wait + step, 1e-12)
    out["headroom"] = _headroom(w, stages, (wait + step) / n)
    out.update(_verdict(share, 1000 * wait / n, 1000 * step / n, out["headroom"]))
    out["advice"] = _advice(out["verdict"], out["leading_stage"])
    return out


def _times(wait: float, step: float, n: int) -> dict:
    return {"steps": n, "wait_ms": 1000 * wait / n if n else 0.0, "step_ms": 1000 * step / n if n else 0.0,
            "wait_share": wait / (wait + step) if wait + step > 0 else 0.0}


def _memory(w) -> dict | None:
    g = w.memory
    if g is None or not g.samples:
        return None
    return {"where": g.where, "last_MB": g.samples[-1][1] / 2**20, "peak_MB": g.peak / 2**20, "growing": g.found}


def _headroom(w, stages: dict | None, cycle: float) -> float | None:
    """How much faster than the loop consumes them the loader's workers could make batches: their work per batch
    (the worker stages) spread over the workers, against one step's cycle. None without stages."""
    if not stages or not w.images or not w.steps:
        return None
    per_batch = sum(v for k, v in stages.items() if k in WORKER_STAGES) * w.images / w.steps
    workers = max(getattr(w.iterable, "num_workers", 0) or 0, 1)
    return workers * cycle / per_batch if per_batch > 0 else None


def _verdict(share: float, wait_ms: float, step_ms: float, headroom: float | None) -> dict:
    spare = "" if headroom is None else f"; the loader's workers could make {headroom:.1f}x the batches it takes"
    v = wait_verdict(share)
    if v == "loader-bound":
        text = (f"loader-bound: {share:.0%} of each step waits for data ({wait_ms:.1f} ms of {wait_ms + step_ms:.1f});"
                f" a loader that kept up would make the loop {1 / (1 - share):.1f}x faster")
    elif v == "device-bound":
        text = (f"device-bound: the step ({step_ms:.1f} ms) sets the pace, {share:.0%} of it waits for data{spare}")
    else:
        text = (f"balanced: {share:.0%} of each step waits for data ({wait_ms:.1f} ms of {wait_ms + step_ms:.1f}): "
                f"the loader only just keeps up{spare}")
    return {"verdict": v, "verdict_text": text}


def _advice(verdict: str, stage: str | None) -> list[str]:
    if verdict == "device-bound":
        return [DEVICE_ADVICE]
    return [ADVICE.get(stage, PLAIN_ADVICE) if stage else PLAIN_ADVICE]


def lines(s: dict) -> list[str]:
    out = [f"fastpipe.watch: {s['steps']:,} steps, {s['images']:,} images"]
    out.append(f"  {s['verdict_text']}")
    first, steady = s["first_steps"], s["steady"]
    if first["steps"]:
        out.append(f"  first {first['steps']} steps (warm-up, reported apart): {first['wait_ms']:.1f} ms waiting, "
                   f"{first['step_ms']:.1f} ms step; after: {steady['wait_ms']:.1f} ms waiting, "
                   f"{steady['step_ms']:.1f} ms step")
    if s["device_ms_per_step"] is not None:
        out.append(f"  device time per step: {s['device_ms_per_step']:.1f} ms (CUDA events)")
    stages = s["stages_ms_per_image"]
    if stages:
        out.append("  loader time per image: " + ", ".join(f"{k} {v:.2f} ms" for k, v in stages.items()))
    elif stages is None:
        out.append("  no stage timing: not a fastpipe loader (wait against step only)")
    mem = s["memory"]
    if mem:
        out.append(f"  memory ({mem['where']}): {mem['last_MB']:,.0f} MB now, peak {mem['peak_MB']:,.0f} MB"
                   + (f"; {mem['growing']['text']}" if mem["growing"] else ", no steady growth seen"))
    out += [f"  try: {a}" for a in s["advice"]]
    return out

"""What `fastpipe.watch` says: the summary of a watched loop (a dict) and its few lines, in `fastpipe bench`'s words
and thresholds (verdict.py)."""

from __future__ import annotations

from fastpipe.bench.verdict import MIN_SECONDS, MIN_STEPS
from fastpipe.loaders.stats import WORKER_STAGES, leading_stage, wait_verdict

ADVICE = {
    "read": "reading dominates: keep the shards on a local disk or give the node cache a fast one (cache_dir=), and "
            "more workers to overlap fetching",
    "decode": "decoding dominates: more workers (num_workers=), GPU decoding on CUDA (backend='dali' or 'nvjpeg'), "
              "or smaller stored photos (fastpipe shard --short-side about 1.15 x the image size)",
    "headers": "reading JPEG headers dominates: more workers (num_workers=)",
    "assemble": "finishing batches dominates: samples that fail are being replaced (fastpipe inspect --verify "
                "names them)",
    "device": "the training process's own part dominates (the copy to the device, normalisation, device "
              "augmentation; with nvjpeg the decoding on the GPU too): on a CPU it competes with the step; "
              "normalize=False hands uint8 batches to a model that normalises itself",
}
DEVICE_ADVICE = ("the step sets the pace: mixed precision, channels_last, a larger batch if memory allows "
                 "(fastpipe memory), torch.compile")
PLAIN_ADVICE = ("more DataLoader workers and pin_memory=True; fastpipe's loader times its stages and says which "
                "one to change")
UNTIMED_ADVICE = ("this backend's stages are not timed (DALI runs its own pipeline): `fastpipe bench --backend "
                  "dali,nvjpeg,torch --workers 2,auto` compares backends and worker counts")


def summary(w) -> dict:
    """The summary of a watch.Watch."""
    wait, step, n = w.steady
    stages, workers = w.stages(), getattr(w.iterable, "num_workers", 0) or 0
    out = {"steps": w.steps, "warmup_steps": w.first[2], "images": w.images,
           "first_steps": _times(*w.first), "steady": _times(wait, step, n),
           "stages_ms_per_image": None if stages is None else {k: 1000 * v for k, v in stages.items()},
           "leading_stage": leading_stage(stages, workers) if stages else None,
           "device_ms_per_step": 1000 * w.device_s / w.device_steps if w.device_steps else None,
           "memory": _memory(w), "verdict": None, "verdict_text": None, "headroom": None, "advice": []}
    if n < MIN_STEPS or wait + step < MIN_SECONDS:
        out["verdict_text"] = (f"no verdict yet: {n} step(s) in {wait + step:.2f} s after the {w.warmup} of warm-up, "
                               f"{MIN_STEPS} steps and {MIN_SECONDS:g} s needed (watch(..., warmup=) sets the warm-up)")
        return out
    share = wait / max(wait + step, 1e-12)
    out["headroom"] = _headroom(w, stages, workers, step / n)
    out.update(_verdict(share, 1000 * wait / n, 1000 * step / n, out["headroom"]))
    timed = bool(stages) and any(k in WORKER_STAGES for k in stages)
    out["advice"] = _advice(out["verdict"], out["leading_stage"] if timed else None, stages is not None)
    return out


def _times(wait: float, step: float, n: int) -> dict:
    """Averages over the n steps recorded (a step under way is not one yet)."""
    return {"steps": n, "wait_ms": 1000 * wait / n if n else 0.0, "step_ms": 1000 * step / n if n else 0.0,
            "wait_share": wait / (wait + step) if wait + step > 0 else 0.0}


def _memory(w) -> dict | None:
    g = w.memory
    if g is None or not g.samples:
        return None
    return {"where": g.where, "last_MB": g.samples[-1][1] / 2**20, "peak_MB": g.peak / 2**20, "growing": g.found}


def _headroom(w, stages: dict | None, workers: int, step: float) -> float | None:
    """How many times the batches the step consumes the loader could make, as `fastpipe bench` defines it (loader
    alone / model alone): one step against the loader's wall time per batch, the slower of its workers' stages
    spread over them and its part in the training process (all of it in sequence without workers). None without
    worker stages."""
    if not stages or not w.images or not w.steps or not any(k in WORKER_STAGES for k in stages):
        return None
    per_image = (max(sum(v for k, v in stages.items() if k in WORKER_STAGES) / workers, stages.get("device", 0.0))
                 if workers else sum(stages.values()))
    per_batch = per_image * w.images / w.steps
    return step / per_batch if per_batch > 0 else None


def _verdict(share: float, wait_ms: float, step_ms: float, headroom: float | None) -> dict:
    spare = "" if headroom is None else f"; the loader could make {headroom:.1f}x the batches the step takes"
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


def _advice(verdict: str, stage: str | None, fastpipes: bool) -> list[str]:
    if verdict == "device-bound":
        return [DEVICE_ADVICE]
    if stage:
        return [ADVICE[stage]]
    return [UNTIMED_ADVICE if fastpipes else PLAIN_ADVICE]


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

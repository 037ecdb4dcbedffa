"""The judgement of `fastpipe bench`'s figures: whether they can carry a verdict (enough steps, no contradiction),
the verdict (loader-bound, device-bound, balanced) and the advice that follows from it. The measurements are
harness.py's."""

from __future__ import annotations

from fastpipe.loaders.stats import BUSY_SHARE, WAIT_BOUND, WAIT_FREE, WORKER_STAGES, leading_stage
from fastpipe.util import usable_cores

MIN_STEPS, MIN_SECONDS = 5, 0.1  # what a measurement must time to carry a verdict
LOADER_SECONDS = 1.0  # ... and a loader alone at least this long: its first batches may come from its queues
VERDICTS = ("loader-bound", "device-bound", "balanced")
AGREE = 1.15  # end to end may beat a single measurement's fastest window by this much (noise), not more
DEVICE_BOUND = 0.90  # end to end within 10 % of the model-only rate: the device is the limit
LOADER_BOUND = 0.85  # end to end at >= 85 % of the loader-only rate, and well below the model: the loader
SHARED = 0.6  # ... and end to end at 60 % of model-only or more; further below, loader and model compete


def too_short(figures: dict[str, dict]) -> str | None:
    """Why the measurements cannot carry a verdict (one timed step says nothing), or None."""
    for name, m in figures.items():
        least = LOADER_SECONDS if name == "loader only" else MIN_SECONDS
        if m["steps"] < MIN_STEPS or m["timed_seconds"] < least:
            return (f"the {name} measurement timed {m['steps']} step(s) in {m['timed_seconds']:.2f} s; a figure "
                    f"needs at least {MIN_STEPS} steps and {least:g} s (its steps took longer than the probe's: was "
                    f"the machine busier?): give it more time (--max-seconds), or a smaller --batch-size")
    return None


def busy(figures: dict[str, dict]) -> str | None:
    """The caveat when other processes took a fifth of the CPU during a measurement: its figure may be low, and the
    verdict, which compares the figures, may then change on a quiet machine."""
    shares = {name: m.get("others_cpu_pct") or 0.0 for name, m in figures.items()}
    worst, least = max(shares, key=shares.get), min(shares, key=shares.get)
    if shares[worst] < 100 * BUSY_SHARE:
        return None
    during = f"during {worst}" + (f" ({shares[least]:.0f}% during {least})" if shares[least] < 100 * BUSY_SHARE else "")
    return (f"other processes took {shares[worst]:.0f}% of the CPU {during}: the figures may be low and the verdict "
            f"may differ on a quiet machine; no advice from them (rerun when the machine is quiet)")


def clean(row: dict) -> bool:
    """A verdict from figures measured with the CPU to themselves: what advice may be drawn from."""
    return row.get("verdict") in VERDICTS and not row.get("caveats")


def contradiction(lo: dict, mo: dict, e2e: dict) -> str | None:
    """Figures that cannot all be right: training fed by the loader faster than the loader or the model alone
    (beyond the spread of their windows), or a model-only rate outside the range measured before."""
    for name, alone in (("loader only", lo), ("model only", mo)):
        if e2e["img_per_s"] > AGREE * alone["high"]:
            return (f"end to end ({e2e['img_per_s']:,.1f} img/s) above {name} ({alone['img_per_s']:,.1f}, fastest "
                    f"window {alone['high']:,.1f})")
    return None


def verdict(loader_ips: float, model_ips: float, e2e_ips: float, wait_share: float) -> dict:
    """loader-bound / device-bound / balanced, from the three rates and the share of each step spent waiting.

    The wait share decides first: it is the direct measure of a device starved of data, while the rates were
    measured at different moments (noise of +-10 % on a busy machine). Waiting half the time is loader-bound;
    waiting under a tenth, with end to end near model-only, is device-bound (the gap is the machine: on a CPU the
    loader's workers take cores from the model). Far below model-only without waiting is neither: the loader and
    the model compete for the same cores. headroom = loader / model."""
    headroom = loader_ips / max(model_ips, 1e-9)
    idle = max(0.0, 1 - e2e_ips / max(model_ips, 1e-9))
    ratio = e2e_ips / max(model_ips, 1e-9)
    if wait_share >= WAIT_BOUND or (e2e_ips >= LOADER_BOUND * loader_ips and loader_ips < DEVICE_BOUND * model_ips
                                    and wait_share >= WAIT_FREE):
        v = "loader-bound"
        words = (f"loader-bound: end to end {e2e_ips:,.1f} img/s is held by the loader (alone {loader_ips:,.1f} "
                 f"img/s, {headroom:.2f}x what the model consumes); the device could take {model_ips:,.1f} img/s "
                 f"and sits idle {idle:.0%} of the time ({wait_share:.0%} of each step waits for data)")
    elif ratio >= DEVICE_BOUND or (wait_share < WAIT_FREE and ratio >= SHARED):
        v = "device-bound"
        gap = "" if ratio >= DEVICE_BOUND else (f"; the {1 - ratio:.0%} below model-only is not waiting for data "
                                                 f"(on a CPU the loader's workers share its cores; or noise)")
        words = (f"device-bound: end to end runs at {ratio:.0%} of the model-only rate ({e2e_ips:,.1f} of "
                 f"{model_ips:,.1f} img/s), {wait_share:.0%} of each step waits for data; the loader delivers "
                 f"{headroom:.1f}x what the model consumes{gap}")
    elif wait_share < WAIT_FREE:
        v = "balanced"
        words = (f"balanced: end to end runs at {ratio:.0%} of the model-only rate ({e2e_ips:,.1f} of "
                 f"{model_ips:,.1f} img/s) though only {wait_share:.0%} of each step waits for data: the loader "
                 f"and the model compete for the same cores (the loader alone delivers {loader_ips:,.1f} img/s)")
    else:
        v = "balanced"
        words = (f"balanced: end to end {e2e_ips:,.1f} img/s, below both the loader ({loader_ips:,.1f}) and the "
                 f"model ({model_ips:,.1f}); they compete (on a CPU: for the same cores), {wait_share:.0%} data wait")
    return {"verdict": v, "verdict_text": words, "headroom": headroom, "device_idle": idle}


def advice(r: dict, manifest) -> list[str]:
    """Concrete next steps from the numbers, for a row measured cleanly; none from a row without a verdict or
    measured under load (changing data or settings on noise does harm)."""
    if not clean(r):
        return []
    c, out = r["config"], []
    cuda = c["device"].startswith("cuda")
    workers = r.get("loader_workers")
    stages = r.get("loader_stages_ms_per_image") or {}
    lead = leading_stage(stages, workers or 0) if any(k in WORKER_STAGES for k in stages) else None
    if r["verdict"] in ("loader-bound", "balanced") and lead:
        out.append(f"the loader's time goes mostly to {lead}: {stages[lead]:.2f} of {sum(stages.values()):.2f} ms "
                   f"per image (loader.stats.stages, the workers' summed over {max(workers or 0, 1)})")
    if r["verdict"] in ("loader-bound", "balanced"):
        if workers is not None and workers < usable_cores() and c["backend"] in ("torch", "nvjpeg"):
            out.append(f"more loader workers: {workers} of {usable_cores()} cores in use (--workers)")
        if cuda and c["backend"] == "torch":
            out.append("decode on the GPU: --backend dali (nvJPEG, hardware decoder) or --backend nvjpeg")
        out += _short_side(r, manifest)
        if not cuda:
            out.append("on a CPU-only machine decoding and training share the cores: a GPU, or a smaller "
                       "--image-size, is the larger lever")
    if r["verdict"] in ("device-bound", "balanced"):
        if c["amp"] == "off":
            out.append("mixed precision: --amp fp16 on CUDA (bf16 on recent CPUs)" if cuda else
                       "mixed precision: --amp bf16 where the CPU supports it")
        if cuda and not c["channels_last"]:
            out.append("--channels-last: faster convolutions with Tensor Cores")
        if cuda:
            out.append(f"a bigger batch if memory allows: `fastpipe memory --model {c['model']} --image-size "
                       f"{c['image_size']}` shows the largest that fits; --compile can add 10-30 %")
    return out


def _short_side(r: dict, manifest) -> list[str]:
    """Smaller stored images, when decoding holds training back (loader-bound) and the shards store far more pixels
    than the row trained at; never below the image size measured, which is the size this advice is for."""
    c, stored = r["config"], manifest.settings.get("short_side")
    size = c["image_size"]
    if r["verdict"] != "loader-bound" or not stored or stored <= 1.5 * size:
        return []
    return [f"if you train at {size} px: store smaller images, re-shard with --short-side {max(int(size * 1.15), size)}"
            f" (now {stored}; decode cost grows with stored pixels); training at a larger size needs at least that "
            f"size stored"]

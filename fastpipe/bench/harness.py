"""Three measurements of one training setup, and the verdict: is the loader or the device the bottleneck?

1. loader only: the real loader, no model — what the input pipeline delivers, as training receives it;
2. model only: the training step (forward, backward, optimizer) fed by the synthetic backend — the ceiling;
   measured once per model setting and shared by every row of a sweep that has it, so rows differ only by loader;
3. end to end: the training step fed by the real loader, with the share of time spent waiting for data.
All three use the same model, batch, image size and precision, and read the clock only after synchronising the
device (timing.py). `max_seconds` bounds the whole command: one step of each part is timed first, and every
measurement gets the steps its figure needs within it, or nothing is measured and the bench says which budget
would do (plan.py). Headroom, everywhere (text, JSON, README): loader-only ÷ model-only, how many times what the
model consumes the loader can deliver (below 1: the loader cannot keep up).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from fastpipe.bench import parts as real
from fastpipe.bench.config import CPU_BUDGET, SWEPT, BenchConfig, split_sweep  # noqa: F401 (the API)
from fastpipe.bench.plan import PROBE_SECONDS, Allot, Part, Schedule, probe
from fastpipe.bench.timing import Budget, Utilisation, cuda_sync, measure, process_start
from fastpipe.bench.verdict import BUSY_SHARE, MIN_STEPS, advice, busy, contradiction, too_short, verdict
from fastpipe.dataset.loading import load
from fastpipe.errors import ConfigError


def _measure(cfg: BenchConfig, step, allot: Allot) -> dict:
    with Utilisation(cfg.device) as u:
        t = measure(step, sync=cuda_sync(cfg.device), **allot.measure_args(cfg.batch_size))
    return {**t.as_dict(), **u.summary()}


def model_only(cfg: BenchConfig, model: real.Model, allot: Allot) -> dict:
    """The training step on one batch held on the device: what the model consumes with no loader at all."""
    x, y = model.batch

    def timed():
        model.step(x, y)
        return len(y)

    return _measure(cfg, timed, allot)


def loader_only(cfg: BenchConfig, batches, allot: Allot) -> dict:
    def timed():
        x, _ = next(batches)
        return len(x)

    return _measure(cfg, timed, allot)


def end_to_end(cfg: BenchConfig, batches, model: real.Model, allot: Allot) -> dict:
    """The training step fed by the loader, and the share of the time spent waiting for its batches."""
    waited = [0.0]

    def timed():
        t = time.perf_counter()
        x, y = next(batches)
        waited[0] += time.perf_counter() - t
        model.step(x, y)
        return len(y)

    start = time.perf_counter()
    e2e = _measure(cfg, timed, allot)
    e2e["data_wait"] = waited[0] / max(time.perf_counter() - start, 1e-9)
    return e2e


def _per_step(m: dict) -> float:
    return m["timed_seconds"] / max(m["steps"], 1)


def judge(lo: dict, mo: dict, e2e: dict, again: Callable[[], tuple | None] = lambda: None,
          log=lambda line: None) -> dict:
    """The verdict on the three figures of one configuration. Figures too short to mean anything give none;
    figures that contradict each other are measured once more (`again()`: the three anew, or None when the budget
    has no room), and if they still do, the row is 'disturbed', with the CPU share other processes took, instead
    of a verdict."""
    def check(lo, mo, e2e):
        short = too_short({"loader only": lo, "model only": mo, "end to end": e2e})
        return short, None if short else contradiction(lo, mo, e2e)

    short, problem = check(lo, mo, e2e)
    twice = False
    if problem:
        log(f"  {problem}: impossible, measuring the three again")
        redo = again()
        if redo is not None:
            (lo, mo, e2e), twice = redo, True
            short, problem = check(lo, mo, e2e)
    row = {"loader_only": lo, "model_only": mo, "end_to_end": e2e, "headroom": lo["img_per_s"] / mo["img_per_s"],
           "others_cpu_pct": max(m.get("others_cpu_pct") or 0 for m in (lo, mo, e2e))}
    if short:
        row.update(verdict="not measured", verdict_text=f"not measured: {short}")
    elif problem:
        how = "measured twice" if twice else "no time left within --max-seconds to measure it again"
        row.update(verdict="disturbed", verdict_text=f"disturbed: {problem}, {how}; {_others(row)}")
    else:
        row.update(verdict(lo["img_per_s"], mo["img_per_s"], e2e["img_per_s"], e2e["data_wait"]))
    caveat = None if problem else busy({"loader only": lo, "model only": mo, "end to end": e2e})
    row["caveats"] = [caveat] if caveat else []
    return row


def _others(row: dict) -> str:
    share = row["others_cpu_pct"]
    if share >= 100 * BUSY_SHARE:
        return f"other processes took {share:.0f}% of the CPU meanwhile: rerun when the machine is quiet"
    return (f"other processes took only {share:.0f}% of the CPU: the device or this machine's clock varies; "
            f"rerun with more --max-seconds")


def grid(cfg: BenchConfig, sweep: dict[str, list]) -> list[BenchConfig]:
    """Every combination of the swept values (keys are BenchConfig fields), resolved."""
    keys = list(sweep)
    return [replace(cfg, **dict(zip(keys, combo))).resolved()
            for combo in itertools.product(*(sweep[k] for k in keys))]


def _fmt(m: dict) -> str:
    return f"{m['img_per_s']:,.1f} img/s ({m['steps']} steps, {len(m['windows'])} window(s), {m['seconds']:.0f} s)"


def _secs(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.2g}"


def _probe_loader(make_loader, c: BenchConfig) -> tuple[float, float]:
    """Seconds the loader takes to start and deliver its first batch, and seconds a batch after that (as many as
    come in half of PROBE_SECONDS, at least 2, at most 16). The loader is closed again: its row starts it anew."""
    t = time.perf_counter()
    feed = real.batches(make_loader(c))
    next(feed)
    start, t, n = time.perf_counter() - t, time.perf_counter(), 0
    while n < 2 or (n < 16 and time.perf_counter() - t < PROBE_SECONDS / 2):
        next(feed)
        n += 1
    per = (time.perf_counter() - t) / n
    feed.close()
    return start, per


def _probe(configs, ids: dict, sched: Schedule, make_model, make_loader, manifest, log) -> tuple[dict, dict, dict]:
    """One step of each part, timed: each model setting (and its augmentation), each loader's start and batches.
    Returns the models, the augmentation steps, and the rows skipped (their backend is not installed)."""
    models, augs, skipped = {}, {}, {}
    for c in configs:
        m = ids[c.model_key()]
        if m in models:
            continue
        models[m] = model = make_model(c)
        sched.estimate(f"model {m}", probe(lambda model=model: (model.step(*model.batch), model.sync()),
                                                   sched.probe_seconds()))
        log(f"probe: {c.model} (batch {c.batch_size}, {c.image_size}px, amp {c.amp}, {c.device}): "
            f"{_secs(sched.est[f'model {m}'])} s a step")
        if c.augment:
            augs[m] = real.augment_steps(c, manifest)
            for name, step in zip(("plain", "augmented"), augs[m]):
                sched.estimate(f"{name} {m}", probe(step, PROBE_SECONDS))
    for i, c in enumerate(configs):
        try:
            start, per = _probe_loader(make_loader, c)
        except ImportError as e:  # e.g. DALI not installed: the row says so instead of failing the sweep
            skipped[i] = str(e)
            log(f"probe: {c.backend} loader skipped: {str(e)[:100]}")
            continue
        sched.estimate(f"start {i}", start)
        sched.estimate(f"loader {i}", per)
        log(f"probe: {c.backend} loader started in {start:.1f} s, then {per:.3f} s a batch")
    return models, augs, skipped


def _parts(configs, ids: dict, skipped: dict) -> list[Part]:
    parts, seen = [], set()
    for i, c in enumerate(configs):
        if i in skipped:
            continue
        m = ids[c.model_key()]
        if m not in seen:
            seen.add(m)
            parts.append(Part(f"model only {m}", (f"model {m}",)))
            if c.augment:
                parts += [Part(f"plain {m}", (f"plain {m}",)), Part(f"augmented {m}", (f"augmented {m}",))]
        parts += [Part(f"loader only {i}", (f"loader {i}",), start=f"start {i}", loader=True),
                  Part(f"end to end {i}", (f"model {m}", f"loader {i}"))]
    return parts


def _refusal(configs, ids: dict, sched: Schedule) -> str:
    """Why nothing is measured, and the budget (or batch) that would give every row a verdict."""
    c = max(configs, key=lambda c: sched.est[f"model {ids[c.model_key()]}"])
    step = sched.est[f"model {ids[c.model_key()]}"]
    where = "CPU" if c.device == "cpu" else f"GPU ({c.device})"
    batch = sched.batch_that_fits(c.batch_size) if len({x.batch_size for x in configs}) == 1 else None
    rows = f" of {len(configs)} configurations" if len(configs) > 1 else ""
    return (f"{c.model} at {c.image_size} px, batch {c.batch_size} on this {where}: {_secs(step)} s a step; a "
            f"verdict{rows} needs about {sched.suggested_seconds()} s ({MIN_STEPS} timed steps a figure), more "
            f"than --max-seconds {sched.budget.total:g}: use --max-seconds {sched.suggested_seconds()}"
            + (f", or --batch-size {batch}" if batch else ""))


def _augment(c: BenchConfig, m: int, steps: tuple, sched: Schedule, log) -> dict:
    """What the augmentation adds: `img_per_s` is the rate of the difference alone, so that its time per image
    divided by an end-to-end step's is the augmentation's share of that step."""
    plain = _measure(c, steps[0], sched.take(f"plain {m}"))
    augmented = _measure(c, steps[1], sched.take(f"augmented {m}"))
    extra = max(1 / augmented["img_per_s"] - 1 / plain["img_per_s"], 1e-12)  # seconds per image; noise can make it < 0
    out = {"img_per_s": 1 / extra, "ms_per_batch": extra * c.batch_size * 1e3, "plain_img_per_s": plain["img_per_s"],
           "augmented_img_per_s": augmented["img_per_s"]}
    log(f"  augmentation ({c.augment}) adds {out['ms_per_batch']:.1f} ms per batch")
    return out


def bench_rows(configs: list[BenchConfig], manifest, budget: Budget, make_model, make_loader,
               log=lambda line: None) -> list[dict]:
    """Every configuration's three measurements and verdict. First the probe and the plan: when the budget cannot
    hold the figures a verdict needs for every row, a ConfigError says which budget would, before anything is
    measured. make_model(cfg) → parts.Model; make_loader(cfg) → a loader (set_epoch, iteration)."""
    sched = Schedule(budget, configs[0].steps, configs[0].windows, configs[0].warmup)
    ids = {k: n for n, k in enumerate(dict.fromkeys(c.model_key() for c in configs))}
    models, augs, skipped = _probe(configs, ids, sched, make_model, make_loader, manifest, log)
    sched.add(*_parts(configs, ids, skipped))
    if not sched.fits():
        raise ConfigError(_refusal(configs, ids, sched))
    rows, model_figs, aug_figs = [], {}, {}
    for i, c in enumerate(configs):
        if i in skipped:
            rows.append({"config": asdict(c), "skipped": skipped[i]})
            continue
        m = ids[c.model_key()]
        log(f"[{i + 1}/{len(configs)}] {c.backend} workers={c.workers if c.workers is not None else 'auto'} "
            f"batch {c.batch_size} {c.image_size}px")
        if m not in model_figs:  # once per model setting, shared by the rows that have it
            model_figs[m] = model_only(c, models[m], sched.take(f"model only {m}"))
            sched.estimate(f"model {m}", _per_step(model_figs[m]))
            log(f"  model only ({c.model}, {c.amp}, synthetic data on {c.device}): {_fmt(model_figs[m])}")
        if m in augs and m not in aug_figs:
            aug_figs[m] = _augment(c, m, augs[m], sched, log)
        row = _row(i, c, m, models[m], model_figs[m], make_loader, sched, log)
        if m in aug_figs:  # the share of an end-to-end step the augmentation takes
            row["augment_only"] = aug_figs[m]
            row["augment_share"] = row["end_to_end"]["img_per_s"] / max(aug_figs[m]["img_per_s"], 1e-9)
        row["advice"] = advice(row, manifest)
        log(f"  {row['verdict_text']}")
        rows.append(row)
    return rows


def _row(i: int, c: BenchConfig, m: int, model: real.Model, mo: dict, make_loader, sched: Schedule, log) -> dict:
    allot = sched.take(f"loader only {i}")
    loader = make_loader(c)
    feed = real.batches(loader)
    next(feed)  # its start (workers, the first shards): untimed, as planned
    lo = loader_only(c, feed, allot)
    stages = {k: 1000 * v for k, v in getattr(getattr(loader, "stats", None), "per_image", dict)().items()}
    sched.estimate(f"loader {i}", _per_step(lo))
    e2e = end_to_end(c, feed, model, sched.take(f"end to end {i}"))
    log(f"  loader only: {_fmt(lo)}; end to end: {_fmt(e2e)}")

    def again():
        redo = (Part(f"model only {m} again {i}", (f"model {m}",)),
                Part(f"loader only {i} again", (f"loader {i}",), loader=True),
                Part(f"end to end {i} again", (f"model {m}", f"loader {i}")))
        if not sched.fits(*redo):
            return None
        sched.add(*redo)
        figures = (loader_only(c, feed, sched.take(redo[1].key)), model_only(c, model, sched.take(redo[0].key)),
                   end_to_end(c, feed, model, sched.take(redo[2].key)))
        log(f"  again: loader only {_fmt(figures[0])}; model only {_fmt(figures[1])}; end to end {_fmt(figures[2])}")
        return figures

    describe = getattr(loader, "describe", dict)()
    row = {"config": asdict(c), "loader_workers": getattr(loader, "num_workers", None),
           "decoder": describe.get("decoder"), "loader_stages_ms_per_image": stages, **judge(lo, mo, e2e, again, log)}
    if stages:
        log("  loader time per image: " + ", ".join(f"{k} {v:.2f} ms" for k, v in stages.items()))
    feed.close()
    return row


def run_sweep(cfg: BenchConfig, sweep: dict[str, list] | None = None, log=None, started: float | None = None) -> dict:
    """Every configuration of the sweep: model-only once per model setting, loader-only and end to end per row,
    within cfg.max_seconds in all, counted from `started` (a perf_counter time; default: now). `log(line)` reports
    progress as it goes."""
    log = log or (lambda line: None)
    configs = grid(cfg, sweep or {})  # every setting checked (BenchConfig) before anything is measured
    budget = Budget(configs[0].max_seconds, started)
    manifest = load(configs[0].data, cache_dir=configs[0].cache_dir, cache_limit=configs[0].cache_limit)
    log(f"bench: {len(configs)} configuration(s), {budget.describe()}")
    rows = bench_rows(configs, manifest, budget, lambda c: real.model(c, manifest),
                      lambda c: real.loader(c, manifest), log)
    good = [r for r in rows if r.get("verdict") not in (None, "not measured", "disturbed")]
    best = max(good, key=lambda r: r["end_to_end"]["img_per_s"], default=None)
    return {"rows": rows, "best": best["config"] if best else None, "machine": real.machine_info(),
            "sweep": {k: [str(x) for x in v] for k, v in (sweep or {}).items()}, "seconds": budget.elapsed(),
            "headroom_definition": "loader_only / model_only"}


def run_one(cfg: BenchConfig) -> dict:
    """The three measurements and the verdict for one configuration."""
    return run_sweep(cfg)["rows"][0]


__all__ = ["BenchConfig", "bench_rows", "judge", "process_start", "run_one", "run_sweep", "split_sweep", "verdict"]

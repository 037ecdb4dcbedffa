"""fastpipe bench: the three measurements, the plan within --max-seconds, the verdict on setups made slow on
purpose (stand-ins that sleep: their speed does not depend on the CPU), advice, JSON, plot, sweep."""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time

import pytest
import torch

from fastpipe.bench.harness import BenchConfig, bench_rows, judge, run_sweep, verdict
from fastpipe.bench.parts import Model
from fastpipe.bench.plan import PROBE_STEPS, Part, Schedule
from fastpipe.bench.report import figure, plot, table, write_json
from fastpipe.bench.timing import Budget
from fastpipe.bench.verdict import LOADER_SECONDS, MIN_STEPS, advice
from fastpipe.dataset.loading import load
from fastpipe.errors import ConfigError
from fastpipe.loaders import cpu_ops

QUICK = dict(steps=10, windows=2, warmup=1, device="cpu")
SETTINGS = dict(data=".", batch_size=8, steps=10, windows=2, warmup=1, device="cpu")
VERDICTS = ("loader-bound", "device-bound", "balanced", "disturbed", "not measured")
BATCH = (torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.int64))


@pytest.fixture(scope="module")
def manifest(converted):
    return load(converted)  # stored at short side 64


class SleepyLoader:
    """Batches that a thread makes ahead (as a loader's workers fill their queues), one per `seconds` of sleep;
    its start takes `start` seconds."""

    def __init__(self, seconds: float, start: float = 0.0):
        self.seconds, self.start = seconds, start

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        time.sleep(self.start)
        ready, stop = queue.Queue(maxsize=4), threading.Event()

        def produce():
            while not stop.is_set():
                time.sleep(self.seconds)
                while not stop.is_set():
                    try:
                        ready.put(BATCH, timeout=0.05)
                        break
                    except queue.Full:
                        pass

        threading.Thread(target=produce, daemon=True).start()
        try:
            while True:
                yield ready.get()
        finally:
            stop.set()


def sleepy_model(model_s: float, alone_s: float | None = None, calls: list | None = None) -> Model:
    """A training step that sleeps `model_s` (`alone_s` on the synthetic batch, when model-only differs), and
    counts in `calls` the steps taken on the synthetic batch."""
    synthetic = (torch.ones(8, 3, 4, 4), BATCH[1])

    def step(x, y):
        alone = x is synthetic[0]
        if alone and calls is not None:
            calls.append(1)
        time.sleep(alone_s if alone and alone_s is not None else model_s)

    return Model(step, synthetic)


def _bench(manifest, loader_s, model_s, model_alone_s=None, seconds=None, backends=("torch",), build_s=0.0,
           start_s=0.0, calls=None, log=None, **kw) -> list[dict]:
    """bench_rows on stand-ins. loader_s: seconds a batch, or {backend: seconds}."""
    configs = [BenchConfig(**{**SETTINGS, **kw, "backend": b, "max_seconds": seconds}).resolved() for b in backends]

    def make_model(c):
        time.sleep(build_s)
        return sleepy_model(model_s, model_alone_s, calls)

    def make_loader(c):
        return SleepyLoader(loader_s[c.backend] if isinstance(loader_s, dict) else loader_s, start_s)

    return bench_rows(configs, manifest, Budget(configs[0].max_seconds), make_model, make_loader,
                      log or (lambda line: None))


def test_verdict_rules():
    assert verdict(100, 1000, 98, 0.8)["verdict"] == "loader-bound"
    # End to end at 8 % of model-only with 1 % data wait was called device-bound: loader and model compete.
    v = verdict(1200, 88, 7.5, 0.01)
    assert v["verdict"] == "balanced" and "compete for the same cores" in v["verdict_text"]
    assert verdict(5000, 200, 195, 0.01)["verdict"] == "device-bound"
    assert verdict(400, 500, 250, 0.3)["verdict"] == "balanced"
    # Seen on a busy 2-core CI machine: no waiting, end to end 70 % of model-only (workers share the cores).
    v = verdict(1178, 23, 16, 0.01)
    assert v["verdict"] == "device-bound" and "not waiting for data" in v["verdict_text"]
    v = verdict(100, 1000, 98, 0.8)
    # One definition everywhere: headroom = loader ÷ model (below 1: the loader cannot keep up).
    assert v["headroom"] == pytest.approx(0.1) and v["device_idle"] == pytest.approx(0.902)
    assert "idle 90%" in v["verdict_text"] and "0.10x what the model consumes" in v["verdict_text"]
    assert verdict(5000, 200, 195, 0.01)["headroom"] == pytest.approx(25)


def test_a_slow_loader_is_judged_loader_bound(manifest):
    (r,) = _bench(manifest, loader_s=0.06, model_s=0.01)
    assert r["verdict"] == "loader-bound", r["verdict_text"]
    assert r["end_to_end"]["data_wait"] > 0.5 and r["headroom"] < 0.5


def test_a_slow_model_is_judged_device_bound(manifest):
    (r,) = _bench(manifest, loader_s=0.01, model_s=0.06)
    assert r["verdict"] == "device-bound", r["verdict_text"]
    assert r["end_to_end"]["data_wait"] < 0.3 and r["headroom"] > 2


def test_impossible_figures_are_measured_again_then_called_disturbed(manifest):
    """End to end 8x model-only (a model-only figure taken while something else held the machine) printed '658 %
    of the model-only rate' as a verdict. Now: measured again, and when it stays impossible, no verdict and no
    advice."""
    (r,) = _bench(manifest, loader_s=0.002, model_s=0.005, model_alone_s=0.08)
    assert r["verdict"] == "disturbed" and "measured twice" in r["verdict_text"], r["verdict_text"]
    assert "above model only" in r["verdict_text"] and "other processes took" in r["verdict_text"]
    assert r["advice"] == []


def test_a_slow_model_and_fast_loader_get_a_verdict_within_the_budget(manifest):
    """resnet50 on a CPU (one step a large share of the budget) beside DALI (fast): both rows were 'not measured'
    ('timed 1 step(s)'; the loader's 1 step because the model's steps had used its share), model-only was measured
    again for the second row, and the command ran 272 s of 180. Now one step of each part is timed first,
    model-only is measured once for both rows, in few long windows, the loader is timed by images over at least a
    second, and the whole run (building the model, starting the loaders and the probe included) keeps to the
    budget. What --steps/--windows ask is far more than fits."""
    calls, lines = [], []
    start = time.perf_counter()
    rows = _bench(manifest, loader_s={"torch": 0.004, "dali": 0.002}, model_s=0.45, seconds=15,
                  backends=("torch", "dali"), build_s=0.1, start_s=0.05, steps=20, windows=3, warmup=3,
                  calls=calls, log=lines.append)
    spent = time.perf_counter() - start
    assert [r["verdict"] for r in rows] == ["device-bound", "device-bound"], [r["verdict_text"] for r in rows]
    mo = rows[0]["model_only"]
    assert rows[1]["model_only"] is mo and len(calls) <= PROBE_STEPS + 3 + mo["steps"]  # measured once
    assert mo["steps"] >= MIN_STEPS and len(mo["windows"]) < 3  # fewer, longer windows than asked
    for r in rows:
        lo = r["loader_only"]
        assert lo["steps"] > 20 and lo["timed_seconds"] >= LOADER_SECONDS  # a fast loader measured longer
    assert spent <= 15 * 1.05, lines


def test_a_budget_too_small_is_refused_before_measuring_with_the_budget_that_would_do(manifest):
    """'not measured: timed 1 step(s)' after the whole budget: now the probe says beforehand that no verdict fits,
    with the budget that gives one; nothing is measured. That budget then gives a verdict."""
    calls, lines = [], []
    with pytest.raises(ConfigError) as e:
        _bench(manifest, loader_s=0.01, model_s=0.2, seconds=2, calls=calls, log=lines.append)
    message = str(e.value)
    assert re.search(r"0\.2\d? s a step", message) and "more than --max-seconds 2" in message, message
    assert len(calls) <= PROBE_STEPS and not any(line.startswith("  model only") for line in lines)
    budget = int(re.findall(r"--max-seconds (\d+)", message)[-1])
    (r,) = _bench(manifest, loader_s=0.01, model_s=0.2, seconds=budget)
    assert r["verdict"] in VERDICTS[:3], r["verdict_text"]


def test_the_refusal_names_a_batch_that_fits():
    """A step's time grows with the batch; starts and what was spent so far do not."""
    sched = Schedule(Budget(180), steps=20, windows=3, warmup=3)
    sched.budget.start -= 24  # the interpreter, the imports and the probe
    sched.estimate("model", 16)
    for i in (0, 1):
        sched.estimate(f"loader {i}", 0.2)
        sched.estimate(f"start {i}", 0.7)
    sched.add(Part("model only", ("model",)), *(p for i in (0, 1) for p in (
        Part(f"loader only {i}", (f"loader {i}",), start=f"start {i}", loader=True),
        Part(f"end to end {i}", ("model", f"loader {i}")))))
    # 24 s spent, floors: model only 100 s, each row 2 s for the loader and 101 s end to end, 3 s for the report
    assert not sched.fits() and sched.suggested_seconds() == 370
    assert sched.batch_that_fits(64) == 16  # at 32: 31 s + 151 s, over 180


def test_a_machine_slower_than_probed_gives_not_measured_not_a_verdict(manifest):
    """Steps that become far slower after the probe (the machine got busy) leave figures short of their floor:
    'not measured', with what to do, and the run still ends near its budget."""
    slow = {"now": False}

    def make_model(c):
        def step(x, y):
            time.sleep(0.6 if slow["now"] else 0.02)
            slow["now"] = slow["now"] or x is not model.batch[0]

        model = Model(step, (torch.ones(8, 3, 4, 4), BATCH[1]))
        return model

    cfg = BenchConfig(**{**SETTINGS, "max_seconds": 4}).resolved()
    lines = []
    rows = bench_rows([cfg], manifest, Budget(4), make_model, lambda c: SleepyLoader(0.005), lines.append)
    assert rows[0]["verdict"] == "not measured" and "--max-seconds" in rows[0]["verdict_text"], lines
    assert rows[0]["advice"] == []


def test_advice_only_from_clean_rows_and_never_below_the_size_trained_at(manifest):
    """Under load, the tour's bench (96 px) said 'balanced' and advised re-sharding at --short-side 110, harmful to
    anyone training at 224. Advice that changes data or settings now comes only from a row with a verdict measured
    with the CPU to itself; re-sharding only when decoding holds training back, never below the size measured."""
    def row(rates, size=32, caveats=()):
        return {**verdict(*rates), "config": {"device": "cpu", "backend": "torch", "image_size": size, "amp": "off",
                                              "channels_last": False, "model": "resnet18"},
                "loader_workers": 1, "caveats": list(caveats)}

    loader_bound = row((100, 1000, 98, 0.8))
    assert loader_bound["verdict"] == "loader-bound"
    short = [a for a in advice(loader_bound, manifest) if "--short-side" in a]
    assert short and "if you train at 32 px" in short[0]
    assert int(re.search(r"--short-side (\d+)", short[0]).group(1)) >= 32
    balanced = row((3591, 81.5, 10.7, 0.01))  # the tour's figures under load
    assert balanced["verdict"] == "balanced"
    assert not [a for a in advice(balanced, manifest) if "--short-side" in a]
    busy = row((3591, 81.5, 10.7, 0.01), caveats=["other processes took 60% of the CPU during end to end ..."])
    assert advice(busy, manifest) == []
    for v in ("not measured", "disturbed"):
        assert advice({**loader_bound, "verdict": v}, manifest) == []


def _figure(img_per_s: float, wait: float = 0.0, others: float = 0.0) -> dict:
    """One measurement's figures as measure() and Utilisation give them: 20 steps over 2 s, windows within 2 %."""
    return {"img_per_s": img_per_s, "low": 0.98 * img_per_s, "high": 1.02 * img_per_s, "steps": 20,
            "timed_seconds": 2.0, "seconds": 2.2, "windows": [img_per_s] * 2, "data_wait": wait,
            "others_cpu_pct": others}


def _row(backend: str, workers: int, lo: float, mo: float, e2e: float, wait: float, others: float = 0.0) -> dict:
    figures = (_figure(lo, others=others), _figure(mo), _figure(e2e, wait))
    return {**judge(*figures, again=lambda: figures), "config": {"backend": backend, "workers": workers}, "advice": []}


def test_every_rows_verdict_and_caveat_is_printed():
    rows = [_row("torch", 0, 100, 1000, 98, 0.8, others=40), _row("torch", 2, 1000, 100, 800, 0.0)]
    text = table({"rows": rows, "sweep": {"workers": ["0", "2"]}, "best": rows[0]["config"]})
    assert "workers=0: loader-bound" in text and "workers=2: disturbed" in text and "measured twice" in text
    assert "caveat: other processes took 40% of the CPU during loader only" in text
    disturbed = text.splitlines()[3]
    assert disturbed.startswith("workers=2") and disturbed.count("(") == 3  # its figures in brackets


def test_a_best_configuration_from_single_windows_says_its_noise_is_not_measured():
    """resnet50 on a CPU: one window per measurement, 'best configuration: dali' at 5.3 against torch's 4.9."""
    rows = [_row("torch", 2, 1909, 5.3, 4.9, 0.0), _row("dali", 2, 897, 5.3, 5.3, 0.01)]
    for r in rows:
        r["end_to_end"] = {**r["end_to_end"], "windows": [r["end_to_end"]["img_per_s"]]}
    text = table({"rows": rows, "sweep": {"backend": ["torch", "dali"]}, "best": rows[1]["config"]})
    assert "best configuration: backend=dali" in text and "noise is not measured" in text


def test_the_plot_marks_rows_without_a_verdict_instead_of_drawing_them():
    """bench.png drew a 'not measured' row's bars (DALI end to end 3.0 above model-only 1.7) like any other."""
    from matplotlib.container import BarContainer

    good = _row("torch", 2, 310, 1.7, 1.6, 0.01)
    bad = {**_row("dali", 2, 310, 1.7, 3.0, 0.01), "verdict": "not measured"}
    result = {"rows": [good, bad], "sweep": {"backend": ["torch", "dali"]}, "best": good["config"]}
    ax = figure(result).axes[0]
    bars = [p for c in ax.containers if isinstance(c, BarContainer) for p in c.patches]
    assert len(bars) == 3 and all(abs(b.get_x() + b.get_width() / 2) < 0.5 for b in bars)  # the measured row's
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_x() > 0.5  # a band over the second row
    assert "not measured" in [t.get_text() for t in ax.texts]


def test_sweep_rows_json_and_plot(converted, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # DALI absent: its rows say so, the rest run
    base = BenchConfig(str(converted), model="mobilenet_v3_small", batch_size=8, image_size=32, **QUICK)
    lines = []
    result = run_sweep(base, {"backend": ["torch", "dali"], "workers": [0, 1]}, log=lines.append)
    assert len(result["rows"]) == 4
    assert sum("skipped" in r for r in result["rows"]) == 2
    done = [r for r in result["rows"] if "skipped" not in r]
    for r in done:
        for key in ("loader_only", "model_only", "end_to_end"):
            assert {"img_per_s", "low", "high", "windows", "cpu_pct", "others_cpu_pct", "steps"} <= set(r[key])
        assert r["verdict"] in VERDICTS and r["verdict_text"]  # any verdict: the machine may be busy
        assert r["config"]["device"] == "cpu" and r["config"]["amp"] == "off"
        assert r["decoder"] == cpu_ops.active()  # which JPEG decoder the figures are of
    assert result["machine"]["torch"] and (result["best"] is None or result["best"]["backend"] == "torch")
    assert len(lines) >= 6 and sum(line.startswith("  model only (") for line in lines) == 1
    text = table(result)
    assert "workers=0" in text and "skipped" in text and "workers=0: " in text.split("(images/s")[1]
    assert ("best configuration" in text) == (result["best"] is not None)
    write_json(result, str(tmp_path / "b.json"))
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["config"]["model"] == "mobilenet_v3_small"
    plot(result, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_max_seconds_bounds_each_measurement_and_the_floor_is_kept():
    """A budget far below what the steps ask for (3 windows x 200 steps of 50 ms): each measurement ends at its share;
    the floor (min_steps) is taken even past the share, but never past the hard limit. Steps that sleep: the bound
    holds on a busy machine."""
    from fastpipe.bench.timing import measure

    def step():
        time.sleep(0.05)
        return 8

    for _ in range(2):
        start = time.perf_counter()
        t = measure(step, warmup=3, windows=3, window_images=200 * 8, max_seconds=1.0)
        assert 0 < t.images < 3 * 200 * 8 and t.steps >= 3
        assert time.perf_counter() - start < 1.0 + 0.5
    t = measure(step, warmup=0, windows=2, window_images=200 * 8, min_steps=10, max_seconds=0.1)
    assert t.steps >= 10  # the floor, past the share
    start = time.perf_counter()
    t = measure(step, warmup=0, windows=2, window_images=200 * 8, min_steps=40, max_seconds=0.1, hard_seconds=0.5)
    assert t.steps < 40 and len(t.windows) == 1 and time.perf_counter() - start < 0.5 + 0.2


def test_cli_bench_prints_progress_and_respects_the_cap(converted):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "fastpipe", "bench", str(converted), "--model", "resnet18",
                        "--batch-size", "8", "--image-size", "48", "--workers", "0", "--device", "cpu",
                        "--steps", "5", "--windows", "2", "--warmup", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "probe:" in r.stdout and "model only" in r.stdout and "loader only:" in r.stdout
    assert "headroom" in r.stdout


def test_cli_bench_refuses_a_budget_too_small_before_measuring(converted):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "fastpipe", "bench", str(converted), "--model", "resnet18",
                        "--batch-size", "8", "--image-size", "48", "--workers", "0", "--device", "cpu",
                        "--max-seconds", "0.5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "s a step" in r.stderr and int(re.findall(r"--max-seconds (\d+)", r.stderr)[-1]) > 1
    assert "model only" not in r.stdout and "probe:" in r.stdout


def test_cli_bench_shows_the_augmentation_share(converted, tmp_path):
    import subprocess

    base = [sys.executable, "-m", "fastpipe", "bench", str(converted), "--model", "mobilenet_v3_small",
            "--batch-size", "8", "--image-size", "48", "--workers", "0", "--device", "cpu", "--steps", "5",
            "--windows", "2", "--warmup", "1"]  # within the CPU's default budget, 300 s, even on a busy machine
    r = subprocess.run([*base, "--augment", "randaug:2:9,mixup:0.2", "--json", str(tmp_path / "b.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "augmentation (randaug:2:9,mixup:0.2) adds" in r.stdout and "of each end-to-end step" in r.stdout
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["config"]["augment"] == "randaug:2:9,mixup:0.2"
    assert 0 < row["augment_share"] <= 1 and row["augment_only"]["ms_per_batch"] > 0
    bad = subprocess.run([*base, "--augment", "randaug:2:9,blur"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "blur" in bad.stderr and "mixup" in bad.stderr and "Traceback" not in bad.stderr


def test_a_fresh_process_run_returns_its_json_or_stops_with_its_error():
    """Benchmarks run conversions in fresh processes: the result is the last JSON line, whatever else the child
    printed; a failure stops the benchmark with the child's own error, not 'exit status 1'."""
    from fastpipe.bench.timing import run_fresh

    assert run_fresh(["-c", "print('progress'); print('{\"img_per_s\": 5}')"], "a run") == {"img_per_s": 5}
    with pytest.raises(SystemExit, match=r"(?s)the shard run failed.*no such folder: /nowhere"):
        run_fresh(["-c", "raise FileNotFoundError('no such folder: /nowhere')"], "the shard run")


def test_rows_within_each_others_noise_are_no_difference():
    """threads=False named best at 21.4 img/s against threads=True's 20.5, windows overlapping: no difference."""
    rows = [_row("torch", 2, 400, 30, 21.4, 0.01), _row("torch", 2, 400, 30, 20.5, 0.01)]
    rows[0]["config"]["threads"], rows[1]["config"]["threads"] = False, True
    rows[0]["end_to_end"] = {**rows[0]["end_to_end"], "low": 20.1, "high": 22.0}
    rows[1]["end_to_end"] = {**rows[1]["end_to_end"], "low": 19.8, "high": 21.2}
    text = table({"rows": rows, "sweep": {"threads": ["False", "True"]}, "best": rows[0]["config"]})
    assert "best configuration: no difference between threads=False" in text and "threads=True" in text, text
    rows[1]["end_to_end"] = {**rows[1]["end_to_end"], "low": 15.0, "high": 16.0}  # clearly apart: a best one
    text = table({"rows": rows, "sweep": {"threads": ["False", "True"]}, "best": rows[0]["config"]})
    assert "best configuration: threads=False (21.4 img/s" in text and "no difference" not in text, text

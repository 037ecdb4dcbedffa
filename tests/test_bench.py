"""fastpipe bench: the three measurements, the verdict on setups made slow on purpose, JSON, plot, sweep."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
from PIL import Image

from fastpipe.bench.harness import BenchConfig, run_one, run_sweep, verdict
from fastpipe.bench.report import plot, table, write_json
from fastpipe.loaders import cpu_ops

QUICK = dict(steps=2, windows=2, warmup=1, device="cpu")


def test_verdict_rules():
    assert verdict(100, 1000, 98, 0.8)["verdict"] == "loader-bound"
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


@pytest.fixture(scope="module")
def png_shards(tmp_path_factory):
    """Foreign shards of large PNGs (no DCT shortcut, slow to decode), adopted with `fastpipe index`."""
    from fastpipe.convert.foreign import IndexConfig, index_shards

    wds = pytest.importorskip("webdataset")
    out = tmp_path_factory.mktemp("png")
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(out / "train-%03d.tar"), maxcount=24) as sink:
        for i in range(48):
            a = rng.integers(0, 255, (900, 1200, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(a).save(buf, "PNG", compress_level=1)
            sink.write({"__key__": f"s{i:03d}", "png": buf.getvalue(), "cls": str(i % 2).encode()})
    shards = sorted(out.glob("train-*.tar"))
    index_shards(IndexConfig(shards, None, [], None, 4))
    return out


def test_slow_loader_is_judged_loader_bound(png_shards):
    # batch 24: the model alone runs 4-5x faster than the PNG loader here (1 and 2 threads), so the verdict has margin
    r = run_one(BenchConfig(str(png_shards), model="mobilenet_v3_small", batch_size=24, image_size=32, workers=0,
                            **QUICK))
    assert r["verdict"] == "loader-bound", r["verdict_text"]
    assert r["end_to_end"]["data_wait"] > 0.5
    assert any("workers" in a for a in r["advice"])


def test_heavy_model_is_judged_device_bound(converted):
    r = run_one(BenchConfig(str(converted), model="resnet50", batch_size=8, image_size=64, workers=1, **QUICK))
    assert r["verdict"] == "device-bound", r["verdict_text"]
    assert r["loader_only"]["img_per_s"] > 3 * r["model_only"]["img_per_s"], (r["loader_only"], r["model_only"])
    assert any("mixed precision" in a for a in r["advice"])


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
            assert {"img_per_s", "low", "high", "windows", "cpu_pct"} <= set(r[key])
        assert r["verdict"] in ("loader-bound", "device-bound", "balanced") and r["verdict_text"]
        assert r["config"]["device"] == "cpu" and r["config"]["amp"] == "off"
        assert r["decoder"] == cpu_ops.active()  # which JPEG decoder the figures are of
    assert result["best"]["backend"] == "torch" and result["machine"]["torch"]
    # Model-only is measured once and shared, so rows differ only by their loader; progress was shown.
    assert done[0]["model_only"] is done[1]["model_only"]
    assert sum("model only:" in line for line in lines) == 1 and len(lines) >= 6
    text = table(result)
    assert "workers=0" in text and "skipped" in text and "best configuration" in text
    write_json(result, str(tmp_path / "b.json"))
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["config"]["model"] == "mobilenet_v3_small"
    plot(result, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_max_seconds_bounds_the_whole_bench(converted):
    """A budget far below what the steps ask for (3 windows x 200 steps): the run ends near it, not after them."""
    cfg = BenchConfig(str(converted), model="resnet18", batch_size=8, image_size=64, workers=0, steps=200,
                      windows=3, warmup=3, device="cpu", max_seconds=6)
    result = run_sweep(cfg)
    row = result["rows"][0]
    assert result["seconds"] < 6 * 1.5 + 5, result["seconds"]  # margin: one slow step per measurement
    assert row["loader_only"]["images"] > 0 and row["model_only"]["images"] > 0
    assert row["end_to_end"]["images"] < 3 * 200 * 8


def test_cli_bench_prints_progress_and_respects_the_cap(converted):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "fastpipe", "bench", str(converted), "--model", "resnet18",
                        "--batch-size", "8", "--image-size", "48", "--workers", "0", "--device", "cpu",
                        "--max-seconds", "6"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "model only:" in r.stdout and "loader only:" in r.stdout and "headroom" in r.stdout


def test_cli_bench_shows_the_augmentation_share(converted, tmp_path):
    import subprocess

    base = [sys.executable, "-m", "fastpipe", "bench", str(converted), "--model", "mobilenet_v3_small",
            "--batch-size", "8", "--image-size", "48", "--workers", "0", "--device", "cpu", "--max-seconds", "8"]
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

"""The training loop on CPU: it learns, accumulates, resumes, records; torchrun; the memory accounting."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fastpipe.dataset.loading import load
from fastpipe.errors import ConfigError
from fastpipe.options import IMAGENET_MEAN_STD, normalize_text
from fastpipe.train.config import TrainConfig, image_size_for_epoch, resumed_config
from fastpipe.train.loop import Dist, Trainer, TrainingStopped, make_schedule
from fastpipe.train.memory import MemoryConfig, analyse, optimizer_state_factor, static_bytes
from fastpipe.train.models import build_model
from fastpipe.train.runs import format_runs, list_runs
from fastpipe.train.session import resolve, train

FAST = dict(model="resnet18", batch_size=8, image_size=32, workers=1, device="cpu", log_every=2,
            warmup_epochs=0.5)


def epochs(run: Path) -> list[dict]:
    """The per-epoch records of a run's metrics.jsonl (it also holds step records)."""
    from fastpipe.train.runs import Run

    return Run(run).epochs()


def cfg(data, out, **kw) -> TrainConfig:
    return TrainConfig(data=str(data), out=str(out), **{**FAST, **kw})


@pytest.fixture(scope="module")
def one_epoch_run(converted, tmp_path_factory) -> Path:
    """A run stopped after epoch 1 of 2 (no loader workers), trained once: tests copy it (`stopped_copy`)."""
    out = tmp_path_factory.mktemp("stopped") / "r"
    train(cfg(converted, out, epochs=2, stop_after=1, workers=0))
    return out


def stopped_copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_short_run_learns_and_records_everything(converted, tmp_path):
    # AdamW 1e-3: reached val acc 1.0 in 8 of 8 runs (seeds 0-3 x 1 and 2 threads); SGD at lr 0.05 or 0.02 with
    # batch 8 diverged in some of them (0.22-0.78). The threshold keeps a wide margin below what it reaches.
    run = train(cfg(converted, tmp_path / "runs" / "a", epochs=3, optimizer="adamw", lr=1e-3))
    metrics = epochs(run)
    assert [m["epoch"] for m in metrics] == [0, 1, 2]
    assert metrics[-1]["val_acc"] > 0.8  # chance is 1/3: the colours are learnable
    for key in ("train_loss", "img_per_s", "data_wait", "val_loss", "per_class_acc", "confusion", "lr"):
        assert key in metrics[0]
    assert 0 <= metrics[0]["data_wait"] <= 1 and len(metrics[-1]["confusion"]) == 3
    # the verdict of the epoch's wait for data, and where the loader's time went (the torch backend's stages)
    assert metrics[0]["verdict"] in ("loader-bound", "balanced", "device-bound")
    assert {"read", "decode", "assemble", "device"} <= set(metrics[0]["loader_ms_per_image"])
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["model"] == "resnet18" and config["train"]["amp"] == "off"
    assert config["versions"]["torch"] == torch.__version__ and config["loader"]["num_workers"] == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_done"] == 3
    assert (run / "curves.png").stat().st_size > 5000 and (run / "confusion.png").stat().st_size > 3000
    # from scratch: the data set's own statistics, recorded in the run and with the weights
    m = load(converted)
    assert config["train"]["normalize"] == "dataset"
    assert config["normalization"] == {"setting": "dataset", "mean": list(m.mean), "std": list(m.std)}
    assert torch.load(run / "last.pt", weights_only=True)["normalize"] == normalize_text(m.mean, m.std)
    rows = list_runs(tmp_path / "runs")
    assert rows[0]["run"] == "a" and "val acc" in format_runs(rows)


def test_an_epoch_trained_beside_busy_programs_is_said_to_be_disturbed(converted, tmp_path, capsys):
    """Epochs swung 6x with the same settings while other programs ran, without a word: an epoch measured while
    others took a fifth of the CPU or more says so, as bench does, and leaves the run's speed figure."""
    import os

    from fastpipe.train.speed import run_speed

    # other programs, not this one's children (a loader's workers are its own): started through a shell that exits
    spin = f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    busy = [int(subprocess.run(["sh", "-c", spin], capture_output=True, text=True, timeout=60).stdout)
            for _ in range(os.cpu_count() or 1)]
    try:
        run = train(cfg(converted, tmp_path / "runs" / "busy", epochs=1, workers=0))
    finally:
        for pid in busy:
            os.kill(pid, signal.SIGKILL)
    m = epochs(run)[0]
    assert m["others_cpu_pct"] >= 20, m["others_cpu_pct"]
    assert f"img/s (other programs took {m['others_cpu_pct']:.0f}% of the CPU: not this run's speed)" in \
        capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["img_per_s_disturbed"] is True and summary["disturbed_epochs"] == 1
    assert "(busy)" in format_runs(list_runs(tmp_path / "runs"))
    # a quiet epoch beside it is the run's figure; the disturbed one is left out
    quiet = {"img_per_s": 50.0, "others_cpu_pct": 3.0}
    assert run_speed([quiet, {"img_per_s": 8.0, "others_cpu_pct": 61.0}]) == {
        "img_per_s": 50.0, "disturbed_epochs": 1, "img_per_s_disturbed": False}
    assert run_speed([quiet, {"img_per_s": 8.0, "others_cpu_pct": "61"}])["disturbed_epochs"] == 0  # edited: no


def test_the_pictures_start_rates_at_zero_and_give_each_class_its_count():
    """The throughput axis ran 74.8-76.2, so 2 % looked like a jump; a class's bar said 1.00 of 1 image as it would
    of 100."""
    from fastpipe.train.plots import curves_figure, per_class_figure

    metrics = [{"epoch": e, "train_loss": 1.0, "img_per_s": r, "data_wait": 0.1} for e, r in enumerate((74.8, 76.2))]
    assert curves_figure(metrics).axes[2].get_ylim()[0] == 0
    single = {"val_acc": 0.75, "per_class_acc": [1.0, 0.5, 0.0], "confusion": [[1, 0, 0], [1, 1, 0], [0, 0, 0]]}
    multi = {"val_map": 0.5, "per_class_ap": [0.5, None], "per_class_f1": [0.4, 0.0], "threshold": 0.5,
             "per_class_positives": [2, 0]}
    for last, names, want in ((single, ["red", "green", "blue"], ["red (n=1)", "green (n=2)", "blue (n=0)"]),
                              (multi, ["rust", "scab"], ["rust (n=2)", "scab (n=0)"])):
        ticks = [t.get_text() for t in per_class_figure(last, names).axes[0].get_xticklabels()]
        assert ticks == want


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _trainer(model, accum):
    c = TrainConfig(data=".", lr=1.0, optimizer="sgd", momentum=0.0, weight_decay=0.0, amp="off",
                    accum_steps=accum, warmup_epochs=0, label_smoothing=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Trainer(c, model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), nn.CrossEntropyLoss(),
                   torch.device("cpu"), Dist())


def test_accumulation_matches_one_big_batch():
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,))
    big, small = _tiny(), _tiny()
    streak = torch.zeros((), dtype=torch.int64)
    _trainer(big, 1).step(x, y, 0, 1, streak)
    t = _trainer(small, 4)
    for i in range(4):
        t.step(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4], i, 4, streak)
    for a, b in zip(big.parameters(), small.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(big[0].weight, _tiny()[0].weight)  # a step was taken


def test_resume_equals_an_uninterrupted_run(converted, tmp_path):
    straight = train(cfg(converted, tmp_path / "straight", epochs=2))
    train(cfg(converted, tmp_path / "resumed", epochs=2, stop_after=1))
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["epochs_done"] == 1
    resumed = train(cfg(converted, tmp_path / "resumed", epochs=2, resume=True))
    a = torch.load(straight / "last.pt", weights_only=False)["model"]
    b = torch.load(resumed / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    ma = epochs(straight)
    mb = epochs(resumed)
    assert [m["val_acc"] for m in ma] == [m["val_acc"] for m in mb]
    assert [m["train_loss"] for m in ma] == pytest.approx([m["train_loss"] for m in mb], rel=1e-6)


def test_a_timm_run_from_the_zoos_weights_resumes_as_an_uninterrupted_one(converted, tmp_path, monkeypatch):
    """timm:NAME.TAG with --pretrained zoo (from the Hugging Face cache) and --normalize pretrained typed again on
    resume: the same weights as a run never stopped."""
    timm = pytest.importorskip("timm")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    from safetensors.torch import save_file

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    snap = tmp_path / "hf" / "models--timm--resnet10t.c3_in1k" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    save_file(timm.create_model("resnet10t").state_dict(), str(snap / "model.safetensors"))
    kw = dict(model="timm:resnet10t.c3_in1k", pretrained="zoo", normalize="pretrained", epochs=2)
    straight = train(cfg(converted, tmp_path / "straight", **kw))
    train(cfg(converted, tmp_path / "resumed", stop_after=1, **kw))
    resumed = train(cfg(converted, tmp_path / "resumed", resume=True, **kw))
    a = torch.load(straight / "last.pt", weights_only=False)["model"]
    b = torch.load(resumed / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_existing_run_folder_needs_resume(converted, tmp_path):
    train(cfg(converted, tmp_path / "r", epochs=1))
    with pytest.raises(ValueError, match="--resume"):
        train(cfg(converted, tmp_path / "r", epochs=1))


def test_bf16_autocast_on_cpu(converted, tmp_path):
    run = train(cfg(converted, tmp_path / "bf16", epochs=1, amp="bf16"))
    m = epochs(run)[0]
    assert m["train_loss"] == m["train_loss"] and m["train_loss"] > 0  # finite


def _nan_weights(path: Path) -> str:
    """A resnet18 state dict whose every weight is NaN: every loss of a run that starts from it is NaN."""
    state = build_model("resnet18", 3).state_dict()
    torch.save({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in state.items()}, path)
    return str(path)


@pytest.mark.parametrize("log_every", [2, 1000])
def test_non_finite_losses_stop_with_advice_and_never_finish(converted, tmp_path, log_every):
    """Every loss NaN: the run stops with advice and is recorded as stopped, also when the epoch is shorter than
    --log-every (it ran to the end as 'finished' with loss 0.000)."""
    out = tmp_path / "nan"
    with pytest.raises(TrainingStopped, match=r"not finite.*Lower --lr"):
        train(cfg(converted, out, epochs=2, max_nonfinite=2, log_every=log_every,
                  pretrained=_nan_weights(tmp_path / "nan.pt")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"].startswith("stopped") and summary["epochs_done"] == 0


@pytest.mark.parametrize("bad", ["lr=-1", "momentum=-1", "warmup_epochs=nan", "label_smoothing=2", "weight_decay=-1",
                                 "log_every=0", "stop_after=-1", "seed=-1", "image_size=100000", "epochs=0",
                                 "max_nonfinite=0", "accum_steps=0", "batch_size=-4", "lr=inf"])
def test_every_numeric_setting_is_checked_where_the_config_is_built(bad):
    name, value = bad.split("=")
    value = float(value) if name in ("lr", "momentum", "warmup_epochs", "label_smoothing", "weight_decay") \
        else int(value)
    with pytest.raises(ConfigError, match=rf"--{name.replace('_', '-')} {value!r}: must be"):
        TrainConfig(data=".", **{name: value})


def test_pretrained_weights_say_what_loaded_and_refuse_what_matches_nothing(converted, tmp_path, capsys):
    net = build_model("resnet18", 5)  # another class count: everything but the head loads
    torch.save(net.state_dict(), tmp_path / "r18.pt")
    build_model("resnet18", 3, pretrained=str(tmp_path / "r18.pt"))
    assert "loaded 120 of the model's 122 tensors; left as initialised: fc.bias, fc.weight" in capsys.readouterr().out
    torch.save(build_model("mobilenet_v3_small", 3).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"none of its \d+ tensors matches a ResNet"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "other.pt"))
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="holds a list, not a state dict"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "list.pt"))
    import pickle

    (tmp_path / "code.pt").write_bytes(pickle.dumps(print, protocol=2))  # what weights_only refuses to run
    with pytest.raises(ConfigError, match="not a weights file that can be loaded safely"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "code.pt"))


def test_progressive_resizing_ends_at_full_size():
    c = TrainConfig(data=".", epochs=8, progressive="128:224")
    sizes = [image_size_for_epoch(c, e) for e in range(8)]
    assert sizes[0] == 128 and sizes[-2:] == [224, 224] and sizes == sorted(sizes)
    assert all(s % 32 == 0 for s in sizes)


def test_schedule_warms_up_then_decays():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_schedule(opt, TrainConfig(data=".", epochs=2, warmup_epochs=1), steps_per_epoch=10)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] < lrs[9] and max(lrs) == pytest.approx(1.0, abs=0.1) and lrs[-1] < 0.05


def test_a_run_under_torchrun_ends_its_process_group(converted, tmp_path, monkeypatch):
    """Left to the interpreter's exit, gloo's process group aborted a rank now and then (SIGABRT, 'terminate called
    without an active exception') after training had finished, and torchrun reported the job failed. A one-process
    world, as torchrun describes it in the environment, in this process."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    run = train(cfg(converted, tmp_path / "r", epochs=1, workers=0))
    assert _summary(run)["status"] == "finished" and json.loads((run / "config.json").read_text())["world_size"] == 1
    assert not dist.is_initialized()


@pytest.mark.slow
def test_torchrun_two_processes_gloo(converted, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "ddp"
    r = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29531", "-m", "fastpipe", "train",
                        str(converted), "--epochs", "1", "--batch-size", "4", "--image-size", "32", "--device", "cpu",
                        "--workers", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2
    m = epochs(out)[0]
    splits = load(converted).splits
    # Both ranks' samples are counted; val is seen once in all.
    assert m["train_samples"] == (splits["train"].samples // 8) * 8 and m["val_samples"] == splits["val"].samples


def test_memory_static_figures_by_hand():
    model = build_model("resnet18", num_classes=6)
    params = 11_176_512 + 512 * 6 + 6  # resnet18 without its 1000-class head, plus a 6-class one
    s = static_bytes(model, "sgd")
    assert s["params"] == s["grads"] == s["optimizer"] == params * 4
    assert static_bytes(model, "adamw")["optimizer"] == 2 * params * 4
    assert optimizer_state_factor("sgd", momentum=False) == 0


def test_memory_activations_grow_with_the_batch_and_techniques_save():
    r = analyse(MemoryConfig(model="resnet18", image_size=64, batch_size=32, amp="off", num_classes=6,
                             device="cpu", gpu_memory=2 * 2**30))
    assert r.measured_on.startswith("cpu: saved tensors")
    assert r.params_mb == pytest.approx(11_179_590 * 4 / 2**20)
    assert r.activations_mb_per_image > 0.5 and r.total_mb(64) > r.total_mb(32)
    assert r.max_batch() and r.total_mb(r.max_batch()) <= 2048
    saves = {t["technique"]: t["saves_mb"] for t in r.techniques}
    assert saves["--amp bf16"] > 0 and saves["--image-size 32"] > 0 and saves["--checkpoint-activations"] > 0


def test_memory_figures_from_a_cpu_say_they_are_lower_bounds_where_they_stand():
    """'largest batch that fits: 88' on a CPU read as a plan; it comes from a lower bound said on the first line."""
    from fastpipe.train.memory import MemoryReport, format_report

    config = {"model": "resnet50", "image_size": 224, "batch_size": 128, "optimizer": "sgd", "amp": "off"}
    techniques = [{"technique": "--amp bf16", "total_mb": 4000.0, "saves_mb": 2000.0, "max_batch": 150,
                   "activations_mb_per_image": 30.0}]

    def report(where):
        return MemoryReport(config, where, 90.0, 90.0, 90.0, 0.2, 80.0, 300.0, 8192.0, techniques)

    cpu = format_report(report("cpu: saved tensors (a lower bound of the GPU figure)")).splitlines()
    said = {line.split()[0]: line for line in cpu[1:]}
    assert "at least 80.00 MB per image" in said["activations"] and "a GPU needs at least this" in said["total"]
    assert "largest batch at most 90; measure on the GPU" in said["against"], said["against"]
    assert "fits" not in said["against"].replace("DOES NOT FIT", "")
    assert "total at least" in said["--amp"] and "largest batch at most 150" in said["--amp"]
    gpu = format_report(report("cuda: NVIDIA H100")).splitlines()
    said = {line.split()[0]: line for line in gpu[1:]}
    assert "largest batch that fits: 90" in said["against"] and "at least" not in "\n".join(gpu)


def test_memory_cli_prints_the_breakdown():
    r = subprocess.run([sys.executable, "-m", "fastpipe", "memory", "--model", "resnet18", "--image-size", "64",
                        "--device", "cpu", "--amp", "off", "--gpu-memory", "8GB", "--no-techniques"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "optimizer state" in r.stdout and "largest batch at most" in r.stdout  # a CPU's lower bound
    assert "measuring resnet18 at 64px" in r.stderr  # said before the seconds it takes
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  ") and " MB" in ln}
    mb = [float(ln.split("MB")[0].split()[-1]) for k, ln in lines.items() if k not in ("total", "against")]
    total = float(lines["total"].split("MB")[0].split()[-1])
    assert sum(mb) == pytest.approx(total, abs=0.3)  # the column adds up to its total


# -- on a GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_fp16_gradscaler_run(converted, tmp_path):
    run = train(cfg(converted, tmp_path / "fp16", epochs=2, device="cuda", amp="fp16", lr=0.05))
    m = epochs(run)
    assert m[-1]["peak_mem_mb"] > 0 and m[-1]["val_acc"] > 0.6
    assert json.loads((run / "config.json").read_text())["train"]["channels_last"] is True


@pytest.mark.gpu
def test_out_of_memory_says_what_to_do(converted, tmp_path):
    huge = TrainConfig(data=str(converted), out=str(tmp_path / "oom"), model="resnet50", batch_size=4096,
                       image_size=512, device="cuda", workers=1, epochs=1, amp="off")
    with pytest.raises(TrainingStopped, match="--accum-steps"):
        train(huge)


@pytest.mark.gpu
def test_auto_batch_finds_a_batch_that_trains():
    from fastpipe.train.memory import cuda_peak, find_max_batch

    c = MemoryConfig(model="resnet18", image_size=224, amp="fp16", num_classes=6, device="cuda")
    b = find_max_batch(c, limit=512)
    assert 1 <= b <= 512
    cuda_peak(c, b, torch.device("cuda"))  # it really trains


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["resnet18", "resnet50"])
def test_memory_prediction_within_ten_percent(model):
    from fastpipe.train.memory import cuda_peak

    c = MemoryConfig(model=model, image_size=224, batch_size=64, amp="fp16", num_classes=6, device="cuda")
    predicted = analyse(c, techniques=False).total_mb(64)
    measured = cuda_peak(c, 64, torch.device("cuda")) / 2**20
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_resume_drops_what_was_logged_after_the_last_checkpoint(tmp_path):
    """A kill between logging and the next checkpoint: resuming redoes that work, logged once."""
    from fastpipe.train.runs import Run

    run = Run(tmp_path / "r")
    run.start({"train": {}})
    for e in range(3):
        for s in range(1, 4):
            run.log({"kind": "step", "step": 3 * e + s, "epoch": e})
        run.log({"kind": "epoch", "epoch": e})
    run.truncate_metrics(2, 7)  # the checkpoint: epochs 0-1 done, step 7 of epoch 2
    assert [m["epoch"] for m in run.epochs()] == [0, 1]
    assert [m["step"] for m in run.metrics() if m["kind"] == "step"] == list(range(1, 8))


def test_every_invocation_of_a_run_is_in_its_history_and_no_epoch_is_logged_twice(converted, one_epoch_run,
                                                                                   tmp_path):
    """Stopped, resumed to the end, then extended with --epochs: the summary keeps each part (the interruption was
    recorded nowhere, and `minutes` counted only the last part), and every epoch is logged once."""
    from fastpipe.train.session import train_from_cli

    out = stopped_copy(one_epoch_run, tmp_path / "r")
    train_from_cli({"data": str(converted), "out": str(out), "resume": True})
    train_from_cli({"data": str(converted), "out": str(out), "resume": True, "epochs": 3})
    assert [m["epoch"] for m in epochs(out)] == [0, 1, 2]
    summary = _summary(out)
    history = summary["history"]
    assert [h["status"].split(" ")[0] for h in history] == ["stopped", "finished", "finished"]
    assert [h["from_epoch"] for h in history] == [0, 1, 2] and [h["resumed"] for h in history] == [False, True, True]
    assert summary["minutes"] == pytest.approx(sum(h["seconds"] for h in history) / 60, abs=0.01)
    assert summary["epochs_done"] == 3


def test_tensorboard_shows_every_step_once_across_resumed_invocations(converted, tmp_path):
    """The scalars and pictures of a run, read back with TensorBoard's own reader. The last invocation resumes from
    a checkpoint older than what was logged (a kill between a log line and the next save): the steps it trains
    again replace the old ones instead of being drawn twice."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from fastpipe.train.runs import Run
    from fastpipe.train.session import train_from_cli

    out = tmp_path / "tb"
    train(cfg(converted, out, epochs=2, stop_after=1, workers=0, log_every=1))
    after_first = (out / "last.pt").read_bytes()
    train_from_cli({"data": str(converted), "out": str(out), "resume": True})
    (out / "last.pt").write_bytes(after_first)  # as if killed after logging epoch 2, before saving it
    train_from_cli({"data": str(converted), "out": str(out), "resume": True})
    assert len(list(out.glob("events.out.tfevents.*"))) == 3
    acc = ea.EventAccumulator(str(out), size_guidance={ea.SCALARS: 0, ea.IMAGES: 0})
    acc.Reload()
    logged = [m for m in Run(out).metrics() if m.get("kind") == "step"]
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [m["step"] for m in logged] == sorted(set(steps))  # each step once, in order
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([m["loss"] for m in logged])
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([m["lr"] for m in logged])
    per_epoch = epochs(out)
    for key, tag in (("val_acc", "epoch/val_accuracy"), ("img_per_s", "epoch/images_per_s"),
                     ("data_wait", "epoch/data_wait_share"), ("train_loss", "epoch/train_loss")):
        found = acc.Scalars(tag)
        assert [e.step for e in found] == [m["global_step"] for m in per_epoch], tag
        assert [e.value for e in found] == pytest.approx([m[key] for m in per_epoch]), tag
    assert {"curves", "confusion", "per_class"} <= set(acc.Tags()["images"])


def test_a_resumed_run_never_waits_on_an_event_files_name(tmp_path, monkeypatch):
    """What a resume does with the run folder's event files (Run.open_board at the checkpoint's step + 1), with one
    stamped in the year 2286 and one whose 'stamp' is no number: it waited for the clock to reach 2286, and raised
    ValueError on the other. Each is named in a warning; the wait, by this clock, is a second at most."""
    pytest.importorskip("torch.utils.tensorboard")
    from fastpipe.errors import FastpipeWarning
    from fastpipe.train import board
    from fastpipe.train.runs import Run

    slept = []

    def sleep(seconds):  # a stand-in that never lets a test wait for the year 2286
        slept.append(seconds)
        assert sum(slept) <= 1.5, "waiting on a file's time stamp"
        time.sleep(seconds)

    monkeypatch.setattr(board.time, "sleep", sleep)
    run = Run(tmp_path / "r")
    run.start({"train": {}})
    for name in ("events.out.tfevents.9999999999.x.1.0", "events.out.tfevents.²³.x"):
        (tmp_path / "r" / name).write_bytes(b"")
    with pytest.warns(FastpipeWarning, match=r"events\.out\.tfevents\.9999999999\.x\.1\.0 \(and 1 more\) sorts "
                                             r"after this run's TensorBoard event file"):
        run.open_board(purge_step=5)
    run.board.close()
    assert len(list((tmp_path / "r").glob("events.out.tfevents.*"))) == 3  # this run's file beside them


def test_without_tensorboard_a_run_writes_no_event_files(tmp_path, monkeypatch):
    from fastpipe.train.board import open_board

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what Python does when it isn't installed
    assert open_board(tmp_path, None) is None and not list(tmp_path.iterdir())


# -- how a run ends, and resuming it safely ----------------------------------------------------------------
def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_a_crash_is_recorded_as_failed_not_finished(converted, tmp_path, monkeypatch):
    def broken(self, loader, k):
        raise RuntimeError("the validation disk went away")

    monkeypatch.setattr(Trainer, "evaluate", broken)
    with pytest.raises(RuntimeError):
        train(cfg(converted, tmp_path / "crash", epochs=2))
    assert _summary(tmp_path / "crash")["status"].startswith("failed: RuntimeError: the validation disk")


@pytest.mark.parametrize("sig,status,code", [(signal.SIGINT, "interrupted", 130),
                                             pytest.param(signal.SIGTERM, "interrupted (SIGTERM)", 143,
                                                          marks=pytest.mark.slow)])
def test_ctrl_c_and_sigterm_leave_a_summary_and_the_resume_command(converted, tmp_path, sig, status, code):
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "fastpipe", "train", str(converted), "--epochs", "50",
                          "--batch-size", "8", "--image-size", "32", "--device", "cpu", "--workers", "1",
                          "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300  # a bound, not a timing: the run's first logged step is the event waited for
    metrics = out / "metrics.jsonl"  # made empty at the start, before training (and its signal handling) begins
    while not (metrics.exists() and metrics.stat().st_size) and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err[-2000:]
    assert _summary(out)["status"] == status
    assert f"--out {out} --resume" in err and "Traceback" not in err
    assert f"{signal.Signals(sig).name}: stopping after this step, with a checkpoint" in err  # said when received
    if sig == signal.SIGINT:
        assert "Ctrl-C again to stop at once" in err
        return
    # ... and that command continues the run
    r = subprocess.run([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(out), "--resume",
                        "--epochs", str(_summary(out)["epochs_done"] + 1)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _summary(out)["status"] == "finished"


def test_fine_tuning_normalises_as_the_weights_were_trained(converted, tmp_path, capsys):
    """--pretrained torchvision weights: ImageNet's statistics; weights of a fastpipe run: the ones it recorded;
    --normalize says otherwise; a run recorded before the setting resumes with the data set's, as it ran."""
    cpu = torch.device("cpu")
    torch.save(build_model("resnet18", 5).state_dict(), tmp_path / "torchvision.pt")
    weights = str(tmp_path / "torchvision.pt")
    assert resolve(TrainConfig(data="."), cpu).normalize == "dataset"
    assert resolve(TrainConfig(data=".", pretrained=weights, normalize="dataset"), cpu).normalize == "dataset"
    run = train(cfg(converted, tmp_path / "ft", epochs=1, pretrained=weights))
    assert "--pretrained: inputs normalised as the weights were trained (imagenet: mean 0.485, 0.456, 0.406" \
        in capsys.readouterr().out
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["normalize"] == "imagenet"
    assert config["normalization"]["mean"] == [0.485, 0.456, 0.406] == config["loader"]["normalization"]["mean"]
    assert torch.load(run / "last.pt", weights_only=True)["normalize"] == normalize_text(*IMAGENET_MEAN_STD)
    assert resolve(TrainConfig(data=".", pretrained=str(run / "last.pt")), cpu).normalize == \
        normalize_text(*IMAGENET_MEAN_STD)
    torch.save({"model": {}, "normalize": "bogus"}, tmp_path / "damaged.pt")
    with pytest.raises(ConfigError, match=r"damaged\.pt: its recorded normalisation 'bogus' is not one"):
        resolve(TrainConfig(data=".", pretrained=str(tmp_path / "damaged.pt")), cpu)
    from fastpipe.cli import main

    with pytest.raises(SystemExit) as e:  # refused by the flag's parser, before anything starts
        main(["train", str(converted), "--normalize", "imgnet"])
    assert e.value.code == 2 and "--normalize 'imgnet': use dataset" in capsys.readouterr().err
    old = {"data": ".", "pretrained": weights, "out": "r"}  # config.json of a run from before the setting
    assert resumed_config(old, {}, "r").normalize == "dataset"
    with pytest.raises(ConfigError, match="uint8 images are for make_loader only"):
        TrainConfig(data=".", normalize=False)


def test_resume_uses_the_saved_settings_and_refuses_others(converted, tmp_path, capsys):
    from fastpipe.cli import main

    out = tmp_path / "r"
    base = [str(converted), "--out", str(out), "--device", "cpu", "--workers", "0", "--image-size", "32"]
    assert main(["train", *base, "--epochs", "2", "--stop-after", "1", "--batch-size", "8", "--lr", "0.01"]) == 0
    config = (out / "config.json").read_text()
    capsys.readouterr()
    assert main(["train", str(converted), "--out", str(out), "--resume", "--model", "resnet50"]) == 2
    err = capsys.readouterr().err
    assert "--model resnet50 (the run has resnet18)" in err and len(err) < 600  # not a state_dict dump
    assert main(["train", str(converted), "--out", str(out), "--resume", "--batch-size", "16"]) == 2
    assert "--batch-size 16 (the run has 8)" in capsys.readouterr().err
    assert main(["train", str(converted), "--out", str(out), "--resume", "--normalize", "imagenet"]) == 2
    assert "--normalize imagenet (the run has dataset)" in capsys.readouterr().err
    assert (out / "config.json").read_text() == config  # a refused resume leaves the record as it was
    assert main(["train", str(converted), "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err
    assert main(["train", str(converted), "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert "no run to resume" in capsys.readouterr().err
    # No flags but --resume and --out: the saved batch size, image size, lr and so on, to the end of the run.
    assert main(["train", str(converted), "--out", str(out), "--resume"]) == 0
    saved = json.loads((out / "config.json").read_text())["train"]
    assert (saved["batch_size"], saved["image_size"], saved["lr"]) == (8, 32, 0.01)
    assert _summary(out)["status"] == "finished" and _summary(out)["epochs_done"] == 2
    # Once more: it printed only 'run folder: ...', as if it had trained
    summary = (out / "summary.json").read_text()
    capsys.readouterr()
    assert main(["train", str(converted), "--out", str(out), "--resume"]) == 0
    said = capsys.readouterr().out
    assert "is finished: 2 of 2 epochs trained, nothing to resume" in said, said
    assert f"fastpipe train {converted} --out {out} --resume --epochs N (N above 2)" in said, said
    assert (out / "summary.json").read_text() == summary  # nothing run, nothing recorded


def test_a_crafted_or_damaged_checkpoint_is_refused_without_running_it(converted, tmp_path):
    from fastpipe.train.runs import RunError

    out = tmp_path / "r"
    train(cfg(converted, out, epochs=2, stop_after=1))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"epoch": 0, "model": Evil(), "optimizer": {}, "scheduler": {}, "scaler": {}}, out / "last.pt")
    with pytest.raises(RunError, match=r"last\.pt cannot be loaded"):
        train(cfg(converted, out, epochs=2, resume=True))
    assert not marker.exists()  # the pickle's code never ran
    (out / "last.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(RunError, match="truncated, damaged or foreign"):
        train(cfg(converted, out, epochs=2, resume=True))
    torch.save({"weights": torch.zeros(3)}, out / "last.pt")
    with pytest.raises(RunError, match="not a fastpipe checkpoint"):
        train(cfg(converted, out, epochs=2, resume=True))


def _edit(state: dict, what: str) -> dict:
    """A hand edit of a checkpoint, as a user (or a bad script) might make it."""
    state = {**state, "model": dict(state["model"])}
    if what == "epoch":
        state["epoch"] = 10**12
    elif what == "shape":
        state["model"]["fc.weight"] = torch.zeros(7, 7)
    elif what == "extra":
        state["model"]["extra.weight"] = torch.zeros(3)
    elif what == "optimizer":
        state["optimizer"] = torch.optim.AdamW([nn.Parameter(torch.zeros(2))]).state_dict()
    elif what == "rng":
        state["rng_cpu"] = state["rng_cpu"][:100]
    elif what == "progress":
        state["mid_epoch"] = {"loader": {}, "progress": {"step": 1, "bogus": 3}}
    elif what == "loader":
        state["mid_epoch"] = {"loader": {"epoch": 1.7}, "progress": {"step": 1}}
    return state


@pytest.mark.parametrize("what,says", [("epoch", "its epoch 1000000000000: must be within 0..1"),
                                       ("shape", "size mismatch for fc.weight"), ("extra", "extra.weight"),
                                       ("optimizer", "parameter group"), ("rng", "RNG state"),
                                       ("progress", "unknown fields"), ("loader", "loader state")])
def test_a_hand_edited_checkpoint_is_one_line_naming_the_file(converted, one_epoch_run, tmp_path, capsys, what,
                                                              says):
    """A resumed run trusted last.pt: an epoch of 10**12 ended 'finished' with 1 of 2 epochs; a tensor of another
    shape, a foreign optimizer, a short RNG state ended in a traceback."""
    from fastpipe.cli import main

    out = stopped_copy(one_epoch_run, tmp_path / "r")
    torch.save(_edit(torch.load(out / "last.pt", weights_only=True), what), out / "last.pt")
    capsys.readouterr()
    assert main(["train", str(converted), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "last.pt" in err and says in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("field,value,says", [("lr", "fast", "--lr 'fast': must be a number"),
                                              ("epochs", 2.5, "--epochs 2.5: must be an integer"),
                                              ("model", 18, "--model 18: must be text")])
def test_a_hand_edited_config_json_is_one_line_naming_the_file(converted, one_epoch_run, tmp_path, capsys, field,
                                                               value, says):
    from fastpipe.cli import main

    out = stopped_copy(one_epoch_run, tmp_path / "r")
    config = json.loads((out / "config.json").read_text())
    config["train"][field] = value
    (out / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["train", str(converted), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and says in err and "Traceback" not in err, err


def test_a_partial_last_metrics_line_is_dropped_a_damaged_one_is_named(converted, tmp_path):
    from fastpipe.train.runs import Run, RunError

    out = tmp_path / "r"
    train(cfg(converted, out, epochs=2, stop_after=1))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 1, "train_lo')  # killed while writing
    train(cfg(converted, out, epochs=2, resume=True))
    assert [m["epoch"] for m in Run(out).epochs()] == [0, 1]
    (out / "metrics.jsonl").write_text('{"epoch": 0}\nnot json\n{"epoch": 1}\n')
    with pytest.raises(RunError, match=r"metrics\.jsonl, line 2"):
        Run(out).metrics()
    (out / "metrics.jsonl").write_text('{"epoch": 0}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"epoch": 1}\n')
    with pytest.raises(RunError, match=r"metrics\.jsonl, line 2"):  # nested too deep: damage, not a RecursionError
        Run(out).metrics()


def test_training_without_a_validation_split(tmp_path):
    from conftest import make_folder

    from fastpipe.convert.driver import ShardConfig, shard

    src = make_folder(tmp_path / "src", {"red": 12, "green": 12}, size=(64, 48))
    shard(ShardConfig(src, tmp_path / "data", short_side=48, val_fraction=0, workers=0))
    run = train(cfg(tmp_path / "data", tmp_path / "r", epochs=1))
    m = epochs(run)[0]
    assert "val_acc" not in m and m["train_samples"] == 24
    assert _summary(run)["status"] == "finished" and _summary(run)["best_val_acc"] is None
    assert (run / "curves.png").exists()


def test_an_image_size_above_the_stored_side_warns(converted):
    from fastpipe import make_loader

    with pytest.warns(UserWarning, match=r"image_size 96 is larger than the stored short side \(64 px\)"):
        make_loader(converted, "torch", batch_size=4, image_size=96, device="cpu", num_workers=0)


@pytest.mark.slow
def test_what_a_cpu_run_should_know_is_one_line_each(converted, tmp_path):
    """fp16 on a CPU ran about 20x slower than fp32; an image size above the stored side was a raw UserWarning with a
    source line; neither is now: each is one line of fastpipe's, and the run goes on in fp32."""
    r = subprocess.run([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(tmp_path / "r"),
                        "--amp", "fp16", "--image-size", "96", "--epochs", "1", "--batch-size", "8", "--workers", "0",
                        "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fastpipe: warning: --amp fp16 on a CPU is about 20x slower than fp32" in r.stderr
    assert "fastpipe: warning: image_size 96 is larger than the stored short side (64 px)" in r.stderr
    assert "UserWarning" not in r.stderr and "warnings.warn" not in r.stderr and "lr_scheduler" not in r.stderr
    assert json.loads((tmp_path / "r" / "config.json").read_text())["train"]["amp"] == "off"


def test_training_the_photo_folder_suggests_a_new_folder_not_the_photos(folder, capsys):
    from fastpipe.cli import main

    assert main(["train", str(folder), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert f"`fastpipe shard {folder} {folder}-shards`" in err and f"shard SRC {folder}`" not in err


# -- mid-epoch resumption ------------------------------------------------------------------------------------
TRAIN = ["--batch-size", "4", "--image-size", "32", "--device", "cpu", "--workers", "1", "--log-every", "2",
         "--optimizer", "adamw", "--lr", "0.001"]


def _start(converted, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(out),
                             *TRAIN, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(out: Path, step: int, p: subprocess.Popen, timeout=120) -> None:
    from fastpipe.train.runs import Run

    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if (out / "metrics.jsonl").exists() and any(m.get("step", 0) >= step for m in Run(out).metrics()):
            return
        time.sleep(0.02)


def _steps(out: Path) -> list[int]:
    from fastpipe.train.runs import Run

    return [m["step"] for m in Run(out).metrics() if m.get("kind") == "step"]


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_is_bit_identical_to_an_uninterrupted_run(converted, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert _start(converted, straight, "--epochs", "1").wait(300) == 0
    p = _start(converted, cut, "--epochs", "1")
    _wait_for_step(cut, 4, p)  # the epoch has 16 steps of 4 images: this is mid-epoch
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143 and "--resume" in err, err[-2000:]
    state = torch.load(cut / "last.pt", weights_only=True)
    assert state["mid_epoch"] and state["global_step"] < 16, "the signal did not land mid-epoch"
    r = subprocess.run([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(cut), "--resume"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    a = torch.load(straight / "last.pt", weights_only=True)["model"]
    b = torch.load(cut / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    assert _steps(cut) == _steps(straight) == list(range(2, 17, 2))  # no step logged twice or missing
    assert [m["val_acc"] for m in epochs(cut)] == [m["val_acc"] for m in epochs(straight)]
    assert [m["train_loss"] for m in epochs(cut)] == pytest.approx([m["train_loss"] for m in epochs(straight)])


@pytest.mark.slow
def test_a_loader_worker_killed_by_the_system_ends_the_run_with_what_to_do(converted, tmp_path):
    """The out-of-memory killer's SIGKILL to a loader worker ended training with PyTorch's RuntimeError and a
    traceback. Now: what happened and what to change, a checkpoint, the resume command, and a resume that gives the
    bits of an uninterrupted run."""
    import psutil

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert _start(converted, straight, "--epochs", "1").wait(300) == 0
    p = _start(converted, cut, "--epochs", "1", "--threads", "off")
    _wait_for_step(cut, 4, p)
    me = psutil.Process(p.pid)
    workers = [c for c in me.children() if c.cmdline() == me.cmdline()]  # forked loader workers
    assert workers
    for w in workers:
        w.kill()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert "a loader worker process died" in err and "out of memory" in err and "fewer --workers" in err
    assert "--resume continues" in err and json.loads((cut / "summary.json").read_text())["status"].startswith("stop")
    assert torch.load(cut / "last.pt", weights_only=True)["mid_epoch"]
    r = subprocess.run([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(cut), "--resume"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    a = torch.load(straight / "last.pt", weights_only=True)["model"]
    b = torch.load(cut / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_periodic_checkpoint(converted, tmp_path):
    out = tmp_path / "r"
    p = _start(converted, out, "--epochs", "2", "--checkpoint-every", "3")
    _wait_for_step(out, 8, p)
    p.kill()  # SIGKILL: no handler runs, the last periodic checkpoint is all there is
    p.wait()
    r = subprocess.run([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(out), "--resume"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _steps(out) == list(range(2, 33, 2)) and [m["epoch"] for m in epochs(out)] == [0, 1]
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"


def test_errors_csv_names_the_most_confident_mistakes(converted, tmp_path):
    run = train(cfg(converted, tmp_path / "r", epochs=1, lr=1e-4, optimizer="adamw"))  # barely trained: mistakes
    rows = (run / "errors.csv").read_text().splitlines()
    assert rows[0] == "rank,confidence,label,predicted,source,shard,sample" and len(rows) > 1
    first = rows[1].split(",")
    assert first[2] != first[3] and first[4].endswith(".jpg") and first[4].split("/")[0] == first[2]
    conf = [float(r.split(",")[1]) for r in rows[1:]]
    assert conf == sorted(conf, reverse=True)
    assert (run / "errors.jpg").stat().st_size > 5000
    from PIL import Image

    from fastpipe.train.errors import CELL, COLS, _clip

    assert Image.open(run / "errors.jpg").width == min(COLS, len(rows) - 1) * CELL  # no empty columns
    assert _clip("leaf_blight/IMG_20240101_123456.jpg", 12, keep_end=True) == "…_123456.jpg"
    assert _clip("early_blight_of_tomato", 8) == "early_b…"


def test_runs_lists_each_figure_in_its_own_unit():
    from fastpipe.train.runs import format_runs

    text = format_runs([{"run": "a", "img/s": 3.855, "wait%": 2.156, "peak MB": 812.4, "val acc/mAP": 0.9133,
                         "minutes": 12.25, "status": "finished"}])
    assert text.splitlines()[1].split() == ["a", "3.9", "2%", "812", "0.913", "12.2", "finished"]


@pytest.mark.slow
def test_resume_under_torchrun_with_another_process_count(converted, tmp_path):
    out = tmp_path / "ddp"
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.Popen([str(torchrun), "--nproc_per_node", "2", "--master_port", "29533", "-m", "fastpipe", "train",
                          str(converted), "--out", str(out), *TRAIN, "--epochs", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out, 2, p, timeout=180)
    p.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
    p.communicate(timeout=180)
    state = torch.load(out / "last.pt", weights_only=True)
    assert state["step_samples"] == 8  # saved by 2 ranks x batch 4
    r = subprocess.run([sys.executable, "-m", "fastpipe", "train", str(converted), "--out", str(out), "--resume",
                        "--workers", "2"], capture_output=True, text=True, timeout=300)  # now one process
    assert r.returncode == 0, r.stderr[-2000:]
    steps = _steps(out)
    assert steps == sorted(set(steps)) and [m["epoch"] for m in epochs(out)] == [0, 1, 2]


def test_runs_shows_the_settings_that_tell_runs_apart(tmp_path, capsys):
    """Two runs differing in image size and learning rate: those columns are shown, the settings they share are
    not; --columns chooses."""
    from fastpipe.cli import main

    for name, size, lr in (("a", 224, 0.1), ("b", 160, 0.05)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.json").write_text(json.dumps({"train": {
            "model": "resnet18", "batch_size": 64, "image_size": size, "lr": lr, "seed": 0, "out": f"runs/{name}"}}))
    assert main(["runs", str(tmp_path / "runs")]) == 0
    head, a, b = capsys.readouterr().out.splitlines()
    assert "image_size" in head and "lr" in head and "seed" not in head and "out" not in head.split()
    assert "224" in a and "0.1" in a and "160" in b and "0.05" in b
    assert main(["runs", str(tmp_path / "runs"), "--columns", "seed"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "seed" in head and "image_size" not in head


def test_no_validation_mistakes_is_said_and_leaves_no_stale_picture(tmp_path):
    """A run whose last epoch made no mistakes: errors.csv lists none, an earlier errors.jpg goes, and a line says
    why there is no picture."""
    from fastpipe.train.errors import write_errors

    (tmp_path / "errors.jpg").write_bytes(b"an earlier run's")
    said = write_errors(tmp_path, [], None, ["a", "b"])
    assert "no validation mistakes" in said and not (tmp_path / "errors.jpg").exists()
    assert (tmp_path / "errors.csv").read_text().splitlines() == [
        "rank,confidence,label,predicted,source,shard,sample"]

"""The command line as users type it: flags generated from the configs, URLs refused, sizes read as meant,
errors in one line, Ctrl-C and SIGTERM ending with what to do next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_folder

from fastpipe.cli import main


def fp(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastpipe", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("args", [["shard", "pipe:curl x", "{tmp}/out"], ["merge", "pipe:curl x"],
                                  ["index", "pipe:curl x.tar"], ["train", "pipe:curl x"]])
def test_urls_are_refused_with_a_clear_message(tmp_path, folder, args, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([a.format(src=folder, tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert "is a URL" in err and "copy the data to a local disk" in err, err
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir())  # no local folder named 's3:'


def test_make_loader_refuses_a_pipe():
    from fastpipe import make_loader
    from fastpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="is a URL"):
        make_loader("pipe:curl -s https://host/shards")


def test_gpu_memory_as_a_bare_number_means_gigabytes(capsys):
    assert main(["memory", "--model", "resnet18", "--image-size", "32", "--device", "cpu", "--gpu-memory", "8",
                 "--no-techniques"]) == 0
    assert "against 8.0 GB (planning for 92% of it): may fit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["memory", "--gpu-memory", "8 parsecs"])
    assert e.value.code == 2 and "is not a size" in capsys.readouterr().err


def test_shard_size_without_a_unit_is_refused(tmp_path, folder, capsys):
    with pytest.raises(SystemExit):
        main(["shard", str(folder), str(tmp_path / "o"), "--max-shard-size", "256"])
    assert "give the unit" in capsys.readouterr().err


def test_index_in_the_readme_form(tmp_path, capsys):
    import webdataset as wds
    from conftest import COLORS, photo

    for split, n in (("train", 8), ("val", 4)):
        with wds.ShardWriter(str(tmp_path / f"{split}-%06d.tar"), maxcount=4) as sink:
            for i in range(n):
                sink.write({"__key__": f"{split}{i:03d}", "jpg": photo(COLORS["red"], seed=i),
                            "cls": str(i % 2).encode()})
    trains, vals = sorted(tmp_path.glob("train-*.tar")), sorted(tmp_path.glob("val-*.tar"))
    assert main(["index", *map(str, trains), "--val", *map(str, vals)]) == 0
    from fastpipe.dataset.loading import load

    m = load(tmp_path)
    assert m.splits["train"].samples == 8 and m.splits["val"].samples == 4
    # Without --val, shards named val-* form the validation split, and the summary says so.
    assert main(["index", *map(str, trains), *map(str, vals), "--overwrite"]) == 0
    assert "named like validation shards" in capsys.readouterr().out
    assert load(tmp_path).splits["val"].samples == 4


def test_flags_keep_their_names_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--no-nesterov", "--channels-last", "--no-channels-last", "--accum-steps", "--stop-after",
                 "--class-weighted-loss", "--workers"):
        assert flag in text
    assert "(default: 224)" in text
    with pytest.raises(SystemExit) as e:
        main(["train", "x", "--backend", "ffvc"])  # a typo fails at once, before a model is built
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback_a_user_error_does_not(tmp_path):
    r = fp("inspect", tmp_path / "nothing")
    assert r.returncode == 2 and "fastpipe shard" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143,
                                                                                 "terminated (SIGTERM)")])
def test_shard_interrupted_says_how_to_continue(tmp_path, sig, code, word, workers):
    """The signal goes to the whole process group, as a terminal's Ctrl-C or a `kill -- -PGID` does: the run says
    how to continue, and no worker process outlives it."""
    src = make_folder(tmp_path / "src", {"red": 40, "green": 40}, size=(900, 700))
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "fastpipe", "shard", str(src), str(out), "--workers", str(workers),
                          "--max-shard-size", "64KB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 60
    while not list(out.glob("train-*.tar")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err[-2000:]
    assert f"fastpipe shard: {word}; rerun the same command to continue" in err and "Traceback" not in err
    assert not list(Path(out).glob("*.tmp"))
    deadline = time.time() + 60  # the workers' exit is waited for, not a fixed time: a busy machine is slow
    while time.time() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break  # nothing left in the group
        time.sleep(0.05)
    else:
        pytest.fail("a process of the run outlived it")


@pytest.mark.parametrize("args,says", [
    (["train", "d", "--lr", "-1"], "--lr -1.0: must be > 0"),
    (["train", "d", "--momentum", "-1"], "--momentum -1.0: must be >= 0 and < 1"),
    (["train", "d", "--warmup-epochs", "nan"], "--warmup-epochs nan: must be a finite number"),
    (["train", "d", "--label-smoothing", "2"], "--label-smoothing 2.0: must be >= 0 and < 1"),
    (["train", "d", "--weight-decay", "-1"], "--weight-decay -1.0: must be within 0..1"),
    (["train", "d", "--log-every", "0"], "--log-every 0: must be within 1..1000000"),
    (["train", "d", "--stop-after", "-1"], "--stop-after -1: must be >= 1"),
    (["train", "d", "--seed", "-1"], "--seed -1: must be within 0..4294967295"),
    (["shard", "src", "out", "--seed", "-1"], "--seed -1: must be within 0..4294967295"),
    (["train", "d", "--image-size", "100000"], "--image-size 100000: must be within 16..4096"),
    (["train", "d", "--progressive", "32:100000"], "need 32 <= START <= END <= 4096"),
    (["memory", "--image-size", "0"], "--image-size 0: must be within 16..4096"),
    (["memory", "--batch-size", "-4"], "--batch-size -4: must be within 1..65536"),
    (["bench", "d", "--steps", "0"], "--steps 0: must be within 1..1000000"),
    (["bench", "d", "--max-seconds", "-1"], "--max-seconds -1.0: must be > 0"),
    (["bench", "d", "--backend", "torch,trch"], "--backend 'trch': use one of torch, dali, nvjpeg, synthetic"),
    (["bench", "d", "--batch-size", "8,-1"], "--batch-size -1: must be within 1..65536"),
])
def test_a_setting_out_of_its_range_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, args, says):
    """Every numeric flag is checked where its config is built: the value and what is allowed, exit 2, before a
    data set is read or anything is measured (`d` and `src` do not even exist)."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())


def _int_settings():
    """(config class, the arguments it needs, field) for every setting of every command's config that takes an
    integer."""
    import dataclasses
    import typing

    from fastpipe.bench.config import BenchConfig
    from fastpipe.convert.config import ShardConfig
    from fastpipe.convert.demo import DemoConfig
    from fastpipe.convert.foreign import IndexConfig
    from fastpipe.predict.config import ExportConfig, PredictConfig
    from fastpipe.train.config import MemoryConfig, TrainConfig

    needs = {ShardConfig: dict(src="src", out="out"), DemoConfig: dict(out="out"), IndexConfig: {},
             TrainConfig: {}, MemoryConfig: {}, PredictConfig: dict(model="m", src=["x"]),
             ExportConfig: dict(run="r", out="m.onnx"), BenchConfig: {}}
    found = []
    for cls, args in needs.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
            if f.metadata and int in kinds and bool not in kinds:
                found.append(pytest.param(cls, args, f.name, id=f"{cls.__name__}.{f.name}"))
    return found


@pytest.mark.parametrize("cls,args,name", _int_settings())
@pytest.mark.parametrize("value", [True, False])
def test_no_integer_setting_takes_true_or_false(cls, args, name, value):
    """True is the int 1 in Python: TrainConfig(workers=True) and BenchConfig(workers=True) were taken (a number or
    a word was checked, and True is a number). Every integer setting refuses it, naming the flag, the value and what
    it takes; a word where the setting takes one (workers: auto, probe) is still taken."""
    from fastpipe.errors import ConfigError

    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"^{flag} {value}: must be an integer\b[^\n]*$"):
        cls(**args, **{name: value})
    if name == "workers" and cls.__name__ in ("TrainConfig", "BenchConfig"):
        assert cls(**args, workers="probe").workers == "probe"


def test_boolean_settings_sweep_like_the_others():
    from fastpipe.bench.config import BenchConfig, split_sweep
    from fastpipe.cli import build_parser, given

    args = build_parser().parse_args(["bench", "d", "--pin-memory", "on,off", "--workers", "1"])
    base, sweep = split_sweep(given(args, BenchConfig))
    assert sweep == {"pin_memory": [True, False]} and base["workers"] == 1


def test_threads_are_on_off_helper_or_auto_and_bench_sweeps_them(capsys):
    from fastpipe.bench.config import BenchConfig, split_sweep
    from fastpipe.cli import build_parser, given
    from fastpipe.train.config import TrainConfig

    p = build_parser()
    typed = [given(p.parse_args(["train", "d", "--threads", v]), TrainConfig)["threads"]
             for v in ("on", "off", "auto", "helper")]
    assert typed == [True, False, None, "helper"]
    assert split_sweep(given(p.parse_args(["bench", "d", "--threads", "on,off,helper"]), BenchConfig))[1] == {
        "threads": [True, False, "helper"]}
    with pytest.raises(SystemExit):
        p.parse_args(["train", "d", "--threads", "maybe"])
    assert "--threads: 'maybe': use on, off, helper or auto" in capsys.readouterr().err

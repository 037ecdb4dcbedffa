"""`fastpipe.watch` inside a training loop: the verdict from wait against step, where a fastpipe loader's time goes
(stages), and memory that keeps growing. Speeds come from stand-ins that sleep, never from this CPU's speed."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import fastpipe
from fastpipe.errors import ConfigError, FastpipeWarning
from fastpipe.loaders import jpegcrop
from fastpipe.loaders.prepare import CpuDecode


def sleepy(n: int, seconds: float):
    """A stand-in loader: n batches of 4, each `seconds` in coming."""
    for _ in range(n):
        time.sleep(seconds)
        yield torch.zeros(4, 3), torch.zeros(4)


def run(w, step_s: float = 0.0) -> dict:
    for _ in w:
        time.sleep(step_s)
    return w.summary()


def test_a_loop_whose_step_takes_the_time_is_device_bound():
    s = run(fastpipe.watch(sleepy(30, 0.0), warmup=2, log=lambda line: None), step_s=0.02)
    assert s["verdict"] == "device-bound" and s["steps"] == 30 and s["images"] == 120
    assert s["steady"]["step_ms"] >= 20 and s["stages_ms_per_image"] is None  # not a fastpipe loader
    assert "the step sets the pace" in s["advice"][0]


def test_a_plain_dataloader_that_cannot_keep_up_is_loader_bound_without_stages():
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            time.sleep(0.005)
            return torch.zeros(3)

    w = fastpipe.watch(torch.utils.data.DataLoader(Slow(), batch_size=4), warmup=2)
    s = run(w)
    assert s["verdict"] == "loader-bound" and s["steady"]["wait_share"] > 0.9
    assert s["stages_ms_per_image"] is None and "more DataLoader workers" in s["advice"][0]
    assert "loader-bound" in str(w) and "no stage timing" in str(w)


@pytest.fixture
def slow_decode(monkeypatch):
    """Each sample's decode takes 30 ms longer: the stand-in for a slow stage, whatever this CPU's speed (a busy
    machine's stalls of a worker process in its first reads stay well below it). Worker processes are forked, so
    that they have it too (with DALI imported they would start from a clean forkserver)."""
    from fastpipe.loaders import processes

    monkeypatch.setattr(processes, "worker_context", lambda: None)
    real = CpuDecode._decode

    def slowed(self, *args):
        time.sleep(0.03)
        return real(self, *args)

    monkeypatch.setattr(CpuDecode, "_decode", slowed)

    monkeypatch.setattr(jpegcrop, "chunked", lambda: False)  # every sample through _decode


@pytest.mark.parametrize("workers,threads", [(0, None), (2, True), (2, False)])
def test_a_loader_slowed_in_one_stage_is_loader_bound_naming_that_stage(converted, slow_decode, workers, threads):
    loader = fastpipe.make_loader(converted, batch_size=4, image_size=32, device="cpu", num_workers=workers,
                                  threads=threads)
    w = fastpipe.watch(loader, warmup=2)
    s = run(w, step_s=0.001)
    loader.close()
    assert s["verdict"] == "loader-bound" and s["leading_stage"] == "decode", s
    assert s["stages_ms_per_image"]["decode"] >= 30
    assert s["advice"][0].startswith("decoding dominates") and "decode" in str(w)


def test_the_stages_add_up_to_the_time_the_loop_waited(converted, slow_decode):
    """In the training process (no workers) the loader's time is the loop's wait: its stages account for it."""
    loader = fastpipe.make_loader(converted, batch_size=4, image_size=32, device="cpu", num_workers=0)
    for _ in loader:
        pass
    stats = loader.stats
    assert abs(sum(stats.stages.values()) - stats.wait_s) <= 0.05 * stats.wait_s, (stats.stages, stats.wait_s)
    assert sum(stats.per_image().values()) * (stats.samples + stats.skipped) == pytest.approx(
        sum(stats.stages.values()))


def test_every_backend_here_is_watched_and_epochs_add_up(converted):
    for backend in ("torch", "synthetic"):
        loader = fastpipe.make_loader(converted, backend, batch_size=4, image_size=32, device="cpu", num_workers=0)
        w = fastpipe.watch(loader, warmup=1)
        for _ in range(2):  # two epochs: the loader's stats restart, the watch's add up
            run(w, step_s=0.005)
        s = w.summary()
        assert s["steps"] == 2 * len(loader) and s["verdict"] in ("device-bound", "balanced", "loader-bound")
        assert (s["stages_ms_per_image"] or {}).keys() == ({"read", "decode", "assemble", "device"}
                                                          if backend == "torch" else {"device"})


def test_every_n_steps_a_line_and_a_writer_that_fails_is_left_out():
    said = []

    class Broken:
        def add_scalar(self, tag, value, step):
            raise OSError("No space left on device")

    w = fastpipe.watch(sleepy(12, 0.0), every=5, writer=Broken(), warmup=2, log=said.append)
    with pytest.warns(FastpipeWarning, match="the SummaryWriter failed .*No space left on device"):
        s = run(w, step_s=0.002)
    assert s["steps"] == 12 and [line.split(":")[1].strip() for line in said] == ["step 5", "step 10"]


@pytest.mark.parametrize("call,match", [
    (lambda: fastpipe.watch(5), "give what a for loop takes"),
    (lambda: fastpipe.watch([], every=0), "watch every 0: must be >= 1"),
    (lambda: fastpipe.watch([], every=2.5), "watch every 2.5"),
    (lambda: fastpipe.watch([], warmup=-1), "watch warmup -1"),
    (lambda: fastpipe.watch([], writer=object()), "give a torch.utils.tensorboard SummaryWriter"),
])
def test_bad_arguments_are_one_clear_error(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_too_few_steps_give_no_verdict_but_say_why():
    s = run(fastpipe.watch(sleepy(4, 0.0), warmup=2))
    assert s["verdict"] is None and "no verdict yet: 2 step(s) in " in s["verdict_text"]
    assert "after the 2 of warm-up, 5 steps and 0.1 s needed" in s["verdict_text"]


# -- memory that keeps growing ---------------------------------------------------------------------------------------
def training_steps(n: int, keep_graphs: bool, batch: int = 128):
    """A CPU training loop; with keep_graphs, each step's loss is kept with its graph (the input it saved: batch x
    1024 float32 a step), the mistake behind out-of-memory at step 3,000."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 64)
    losses = []
    w = fastpipe.watch((torch.randn(batch, 1024) for _ in range(n)), warmup=20, log=lambda line: None)
    found_at = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, x in enumerate(w, start=1):
            loss = model(x).square().mean()
            losses.append(loss if keep_graphs else loss.item())
            if found_at is None and caught:
                found_at = step
    return w.summary()["memory"], found_at, [str(c.message) for c in caught]


def in_a_fresh_process(steps: int, keep_graphs: bool):
    """training_steps in a new Python process, as a training script starts: this one's heap, after hundreds of
    tests, makes glibc's count slow enough that the watch reads it less often."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_watch as t; "
            "print(json.dumps(t.training_steps(int(sys.argv[2]), sys.argv[3] == 'keep')))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(steps),
                           "keep" if keep_graphs else "drop"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_loop_that_keeps_each_steps_graph_is_flagged_with_its_rate():
    memory, found_at, said = in_a_fresh_process(400, keep_graphs=True)
    growing = memory["growing"]
    assert growing is not None and found_at is not None and found_at <= 300, (memory, found_at)
    true_rate = 128 * (1024 + 64) * 4  # what each step's graph holds: the input, and the output square() saved
    assert abs(growing["bytes_per_step"] - true_rate) <= 0.25 * true_rate, growing
    assert len(said) == 1 and "memory grows" in said[0] and "loss.item()" in said[0] and "full near step" in said[0]


def test_a_flat_loop_is_never_flagged():
    memory, found_at, said = in_a_fresh_process(2000, keep_graphs=False)
    assert memory["growing"] is None and found_at is None and not said, memory


def test_trace_memory_off_cuda_says_so_and_the_watch_has_the_loaders_length(converted):
    loader = fastpipe.make_loader(converted, batch_size=4, image_size=32, device="cpu", num_workers=0)
    w = fastpipe.watch(loader, trace_memory=True)
    assert len(w) == len(loader)
    with pytest.warns(FastpipeWarning, match="names allocation sites on CUDA only"):
        run(w)


@pytest.mark.gpu
def test_on_cuda_the_device_time_and_the_growing_allocation_site_are_named():
    """A CUDA loop that keeps each step's loss with its graph: flagged, and with trace_memory the site of the
    growing allocations is this file's line; the device's time per step comes from events."""
    device = torch.device("cuda")
    model = torch.nn.Linear(1024, 64).to(device)
    batches = (torch.randn(512, 1024, device=device) for _ in range(400))
    w = fastpipe.watch(batches, warmup=20, log=lambda line: None, trace_memory=True)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in w:
            losses.append(model(x.relu()).square().mean())  # x.relu() is allocated here, on this line
    s = w.summary()
    growing = s["memory"]["growing"]
    assert growing is not None and any("test_watch.py" in site["where"] for site in growing["sites"]), growing
    assert s["device_ms_per_step"] is not None and s["device_ms_per_step"] > 0
    assert any("memory grows" in str(c.message) for c in caught)


def test_the_leading_stage_compares_the_workers_share_with_the_training_processs(converted, monkeypatch):
    """Decoding takes 8 ms an image summed over 2 workers (4 ms of the loader's wall time), the training process's
    own part 6 ms an image: that part leads, though the workers' sum is larger."""
    from fastpipe.loaders.base import Loader

    real_decode, real_device = CpuDecode._decode, Loader._to_device

    def decode(self, *args):
        time.sleep(0.008)
        return real_decode(self, *args)

    def to_device(self, batch):
        time.sleep(0.006 * len(batch.labels))
        return real_device(self, batch)

    monkeypatch.setattr(CpuDecode, "_decode", decode)

    monkeypatch.setattr(jpegcrop, "chunked", lambda: False)  # every sample through _decode
    monkeypatch.setattr(Loader, "_to_device", to_device)
    loader = fastpipe.make_loader(converted, batch_size=4, image_size=32, device="cpu", num_workers=2, threads=True)
    s = run(fastpipe.watch(loader, warmup=2))
    loader.close()
    assert s["stages_ms_per_image"]["decode"] > s["stages_ms_per_image"]["device"]
    assert s["leading_stage"] == "device" and s["advice"][0].startswith("the training process's own part"), s


def test_an_early_break_and_batches_of_every_shape_are_counted():
    w = fastpipe.watch([(torch.zeros(4, 3), ["a.jpg"] * 4)] * 3 + [["cat.jpg", "dog.jpg"], {"x": torch.zeros(5)}],
                       warmup=0)
    for _ in w:
        pass
    assert w.summary()["images"] == 3 * 4 + 2 + 5
    for i, _ in enumerate(w):  # a second pass, left after two batches
        if i == 1:
            break
    assert w.steps == 5 + 2


def test_memory_that_steps_up_a_few_times_is_not_a_leak_and_a_slow_leak_is_found_in_time():
    """Stand-in figures, not a process's: a pool that grows three times by 10 MB then stays; a leak of 12 kB a step
    (16 MB takes 1,400 steps: seen on the coarse window of every 16th step)."""
    from fastpipe.bench.growth import Growth

    pool, slow, found_at = Growth(None, "x"), Growth(None, "x"), None
    for k in range(21, 8000):
        assert pool.add(k, (100 << 20) + (10 << 20) * sum(k >= j for j in (60, 100, 140))) is None
        if slow.add(k, (100 << 20) + 12_000 * k + (k % 7) * 100_000) and found_at is None:
            found_at = k
    assert found_at is not None and found_at < 4000 and abs(slow.found["bytes_per_step"] - 12_000) < 3000

"""scripts/setup.sh as a user runs it, in --plan mode (it says what it would install and from where, and installs
nothing): torch's CPU build on a machine without an NVIDIA driver, from PyTorch's CPU index when that answers within
seconds, else the default index, said; the CUDA build where there is a driver or with --gpu; DALI kept. The index is a
server on loopback; the machine's tools are a PATH that has nvidia-smi or not."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fastpipe.testing.devserver import Faults, FolderServer

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"
BASH = shutil.which("bash") or "/bin/bash"  # by its path: the PATH given to the script has no bash
NO_DRIVER = not Path("/proc/driver/nvidia").exists()  # a machine with the kernel driver has it whatever PATH says


def test_the_script_parses():
    assert subprocess.run([BASH, "-n", str(SETUP)]).returncode == 0


def plan(tmp_path: Path, index: str, *args: str, driver: bool = False) -> str:
    """setup.sh --plan's output."""
    return planned(tmp_path, index, *args, driver=driver).stdout


def planned(tmp_path: Path, index: str, *args: str, driver: bool = False) -> subprocess.CompletedProcess:
    """setup.sh --plan from a copy of the script (no .venv beside it), with a PATH of the few tools it runs."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(SETUP, tmp_path / "repo" / "scripts" / "setup.sh")
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for name in ("dirname", "timeout"):
        if (found := shutil.which(name)) and not (tools / name).exists():
            (tools / name).symlink_to(found)
    smi = tools / "nvidia-smi"
    if driver:
        smi.write_text("#!/bin/sh\necho 'GPU 0: a GPU'\n")
        smi.chmod(0o755)
    else:
        smi.unlink(missing_ok=True)
    env = {"PATH": str(tools), "PYTHON": sys.executable, "FASTPIPE_TORCH_CPU_INDEX": index, "HOME": str(tmp_path)}
    r = subprocess.run([BASH, str(tmp_path / "repo" / "scripts" / "setup.sh"), "--plan", *args], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "repo" / ".venv").exists()  # a plan installs nothing
    return r


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def cpu_index(tmp_path):
    """An index's page on loopback (Python's own file server: it serves a folder's index.html)."""
    (tmp_path / "index" / "whl" / "cpu").mkdir(parents=True)
    (tmp_path / "index" / "whl" / "cpu" / "index.html").write_text("<a href='torch/'>torch</a>\n")
    with ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(tmp_path / "index"))) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        server.shutdown()


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has an NVIDIA driver loaded")
def test_without_a_driver_it_installs_the_cpu_build_from_the_cpu_index(tmp_path, cpu_index):
    """On a machine with no GPU it downloaded the CUDA builds of torch and DALI (7.2 GB), silently, for 5 minutes."""
    out = plan(tmp_path, cpu_index)
    assert "machine: no NVIDIA driver (no nvidia-smi, no /proc/driver/nvidia): torch's CPU build" in out, out
    assert f"would install: torch + torchvision, CPU build (~200 MB) from {cpu_index}" in out, out
    assert "would install: DALI for CUDA 13 (nvidia-dali-cuda130, ~270 MB" in out, out  # its CPU pipeline is tested


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has an NVIDIA driver loaded")
def test_an_index_that_does_not_answer_falls_back_to_the_default_index_and_says_so(tmp_path):
    out = plan(tmp_path, f"http://127.0.0.1:{_closed_port()}/whl/cpu")
    assert "Connection refused): falling back to the default index" in out, out
    assert "would install: torch + torchvision from the default index" in out, out


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has an NVIDIA driver loaded")
def test_an_index_that_stalls_is_given_up_after_seconds(tmp_path):
    """A machine that may not reach the index (CI) must not wait for it: the check is bounded."""
    (tmp_path / "index").mkdir()
    with FolderServer(tmp_path / "index", Faults(stall_every=1, stall=120)) as url:
        out = plan(tmp_path, f"{url}/whl/cpu")  # within plan()'s own limit of 120 s, which the stall would pass
    assert "did not answer (timed out): falling back to the default index" in out, out


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has an NVIDIA driver loaded")
@pytest.mark.parametrize("answers", [True, False])
def test_the_index_is_printed_without_its_password_or_token(tmp_path, cpu_index, answers):
    """A mirror's URL with user:password@ or ?token= in it was printed whole: where the index is named (what would be
    installed from it), and where it did not answer (with urllib's 'nonnumeric port' error quoting the password).
    It is shown as pip shows it, the password and every query value as ****."""
    port = cpu_index.split(":")[2].split("/")[0] if answers else str(_closed_port())
    index = f"http://user:PASSW0RD-x@127.0.0.1:{port}/whl/cpu?token=T0KEN-y&channel=stable"
    r = planned(tmp_path, index)
    shown = f"http://user:****@127.0.0.1:{port}/whl/cpu?token=****&channel=****"
    said = r.stdout + r.stderr
    assert "PASSW0RD" not in said and "T0KEN" not in said and "stable" not in said, said
    if answers:
        assert f"would install: torch + torchvision, CPU build (~200 MB) from {shown}\n" in r.stdout, said
    else:
        assert f"but {shown} did not answer (" in r.stdout and "Connection refused)" in r.stdout, said


@pytest.mark.parametrize("driver,args", [(True, ()), (False, ("--gpu",))])
def test_a_driver_or_gpu_flag_keeps_the_cuda_build(tmp_path, cpu_index, driver, args):
    out = plan(tmp_path, cpu_index, *args, driver=driver)
    assert "torch's CUDA build" in out and "would install: torch + torchvision, CUDA build" in out, out
    assert "CPU build" not in out


def test_an_unknown_option_is_refused_naming_the_valid_ones(tmp_path):
    r = subprocess.run([BASH, str(SETUP), "--cpu-only"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "FASTPIPE_TORCH_CPU_INDEX": "http://127.0.0.1:9/"})
    assert r.returncode == 2 and "unknown option --cpu-only (valid: --gpu, --pillow-simd, --plan)" in r.stderr


def test_a_script_run_beside_the_clone_imports_the_installed_package(tmp_path):
    """Run from the folder that holds the clone (a folder named fastpipe, without __init__.py), a script imported
    the clone as an empty namespace package: 'cannot import name Predictor from fastpipe (unknown location)'. The
    environment scripts/setup.sh makes finds the package itself."""
    import fastpipe

    (tmp_path / "fastpipe").mkdir()  # what the clone looks like from its parent folder
    done = subprocess.run([sys.executable, "-c", "import fastpipe; from fastpipe import Predictor; "
                           "print(fastpipe.__file__)"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.strip() == fastpipe.__file__

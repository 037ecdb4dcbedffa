"""`fastpipe doctor`: the "why can't PyTorch see my GPU" checklist as a command.

Each check prints OK / INFO / WARN / FAIL, what it found, and the fix. Exit code 1 only when something is broken
(a GPU this machine has that torch can't use, a package that fails to import). INFO is an optional suggestion (a
faster Pillow, DALI, torch's CPU build where there is no GPU), so a complete install shows no warning.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Check:
    status: str  # OK | INFO (an optional suggestion) | WARN | FAIL
    name: str
    found: str
    fix: str = ""


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def nvidia_smi() -> list[str] | None:
    """Driver version and GPU names from nvidia-smi, or None when there is no NVIDIA driver."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 10)
    return Check("OK" if ok else "FAIL", "python", f"{platform.python_version()} ({sys.executable})",
                 "" if ok else "fastpipe needs Python >= 3.10")


def check_torch(gpus: list[str] | None) -> list[Check]:
    try:
        import torch
    except Exception as e:
        return [Check("FAIL", "torch", f"import failed: {e}", "pip install torch torchvision")]
    checks = []
    cuda_build = torch.version.cuda
    if cuda_build is None:
        status = "FAIL" if gpus else "INFO"
        checks.append(Check(status, "torch build", f"{torch.__version__}, CPU-only build",
                            "torch is a CPU build: reinstall a CUDA wheel matching your driver "
                            "(pytorch.org's install selector gives the pip command)" if gpus else
                            "fine without a GPU; on a GPU machine reinstall a CUDA wheel"))
    elif not gpus:  # works, but several GB of CUDA libraries serve nothing here
        checks.append(Check("INFO", "torch build", f"{torch.__version__}, CUDA {cuda_build} on a machine without an "
                            f"NVIDIA GPU", "the CUDA build (about 3 GB with its libraries) is not needed here: "
                            "scripts/setup.sh installs the CPU build (about 200 MB) where PyTorch's CPU index answers "
                            "(FASTPIPE_TORCH_CPU_INDEX names a mirror); or pip install torch torchvision --index-url "
                            "https://download.pytorch.org/whl/cpu"))
    else:
        checks.append(Check("OK", "torch build", f"{torch.__version__}, CUDA {cuda_build}"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    checks.append(Check("WARN" if visible in ("", "-1") else "OK", "CUDA_VISIBLE_DEVICES",
                        "unset" if visible is None else repr(visible),
                        "an empty or -1 value hides every GPU: unset it" if visible in ("", "-1") else ""))
    if cuda_build is None:
        return checks
    available = torch.cuda.is_available()
    if not available:
        if gpus:
            checks.append(Check("FAIL", "CUDA available", "no", f"the driver ({gpus[0].split(',')[0]}) may be older "
                                f"than CUDA {cuda_build} needs: update the driver or install a torch wheel for an "
                                f"older CUDA"))
        else:  # the same words as the driver line: no GPU here is a fact, not a fault
            checks.append(Check("OK", "CUDA available", "no GPU on this machine: fastpipe runs on the CPU"))
        return checks
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        checks.append(Check("OK", f"cuda:{i}", f"{p.name}, compute {p.major}.{p.minor}, "
                            f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"))
    return checks


def check_driver(gpus: list[str] | None) -> Check:
    if gpus is None:
        return Check("OK", "NVIDIA driver", "none (nvidia-smi not found): needed only on a machine with an NVIDIA GPU")
    return Check("OK", "NVIDIA driver", "; ".join(gpus))


def check_packages() -> list[Check]:
    checks = []
    for name in ("torchvision", "webdataset", "numpy"):
        try:
            mod = __import__(name)
            checks.append(Check("OK", name, getattr(mod, "__version__", "?")))
        except Exception as e:
            checks.append(Check("FAIL", name, f"import failed: {e}", f"pip install {name}"))
    codec = _dist_version("torchcodec")
    checks.append(Check("OK", "torchcodec", codec or "not installed (torchvision.io decodes instead)"))
    return checks


def check_dali() -> Check:
    dists = {d: _dist_version(d) for d in ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110")}
    found = {d: v for d, v in dists.items() if v}
    if not found:
        return Check("INFO", "DALI", "not installed (optional)", "pip install 'fastpipe[dali]' (CUDA 12) or "
                     "'fastpipe[dali-cu13]' (CUDA 13) for the dali backend")
    dist, version = next(iter(found.items()))
    dali_major = dist.rsplit("cuda", 1)[1][:2].lstrip("0")
    try:
        import torch

        torch_major = (torch.version.cuda or "").split(".")[0]
    except Exception:
        torch_major = ""
    if torch_major and torch_major != dali_major:
        return Check("WARN", "DALI", f"{dist} {version} (CUDA {dali_major}) but torch uses CUDA {torch_major}",
                     f"install nvidia-dali-cuda{torch_major}0 so both share one CUDA runtime")
    return Check("OK", "DALI", f"{dist} {version}")


def check_pillow() -> list[Check]:
    import PIL
    from PIL import features

    simd = _dist_version("Pillow-SIMD") or _dist_version("pillow-simd")
    kind = f"pillow-simd {simd}" if simd else f"Pillow {PIL.__version__}"
    turbo = features.check_feature("libjpeg_turbo")
    checks = [Check("OK" if simd else "INFO", "Pillow", kind,
                    "" if simd else "optional: scripts/setup.sh --pillow-simd resizes 4-8x faster"),
              Check("OK" if turbo else "WARN", "libjpeg-turbo", turbo_versions(),
                    "" if turbo else "JPEG decode is 2-3x slower without libjpeg-turbo: rebuild Pillow against it")]
    missing = [f for f in ("webp", "libtiff", "littlecms2") if not features.check(f)]
    if missing:
        checks.append(Check("WARN", "Pillow formats", f"missing {', '.join(missing)}",
                            "photos in these formats will be rejected; rebuild with their -dev headers"))
    return checks


def turbo_versions() -> str:
    """Which libjpeg-turbo each JPEG decoder runs with: the crop decoder's (the library it loaded), simplejpeg's (linked
    into its module) and Pillow's, or 'unknown' where it cannot be told."""
    from PIL import features

    from fastpipe.loaders import cpu_ops, jpegcrop

    crop = "not built" if jpegcrop.ext is None else jpegcrop.runtime_version() or "unknown"
    if jpegcrop.ext is not None and not jpegcrop.crops_fixed():
        crop += (f" (4x2 and 2x4 sampled files are cropped unscaled: libjpeg-turbo "
                 f"{'.'.join(map(str, jpegcrop.FIXED_IN))} fixed their scaled crops)")
    simple = "not installed"
    if cpu_ops.simplejpeg is not None:
        found = Path(cpu_ops.simplejpeg.__file__).parent.glob("_jpeg*")
        module = next((p for p in found if p.suffix in (".so", ".pyd", ".dylib")), None)
        simple = (jpegcrop.version_in(module) if module else None) or "unknown"
    pillow = features.version_feature("libjpeg_turbo") or ("unknown" if features.check_feature("libjpeg_turbo")
                                                           else "none (libjpeg)")
    return f"crop decoder {crop}; simplejpeg {simple}; Pillow {pillow}"


def check_decoder() -> Check:
    """Which JPEG decoder the torch backend's workers run: the crop-aware one, or why not."""
    from fastpipe.loaders import cpu_ops, jpegcrop

    found = cpu_ops.active()
    if jpegcrop.ext is not None and cpu_ops.cv2 is not None:
        return Check("OK", "CPU JPEG decoder", found)
    if jpegcrop.ext is not None:
        return Check("WARN", "CPU JPEG decoder", found, "pip install opencv-python-headless simplejpeg")
    return Check("WARN", "CPU JPEG decoder", found,
                 "install a C compiler and libjpeg-turbo's headers (Debian/Ubuntu: apt-get install gcc "
                 "libjpeg62-turbo-dev; scripts/setup.sh does it), then reinstall fastpipe (pip install -e .): the "
                 "crop-aware decoder decodes only the crop (docs/decode.md)")


def check_cpu() -> Check:
    from fastpipe.loaders.workers import heuristic_workers
    from fastpipe.util import usable_cores

    return Check("OK", "CPU cores", f"{usable_cores()} usable; suggested loader workers {heuristic_workers()} "
                 "(num_workers=\"probe\" measures the best count for a data set and caches it)")


def check_workers() -> Check:
    """Whether the torch backend's loader workers are threads or processes by default here, and why."""
    import sysconfig

    from fastpipe.loaders import cpu_ops
    from fastpipe.loaders.cpu import releases_gil
    from fastpipe.loaders.workers import DEFAULT_THREADS_UP_TO, STEP_PYTHON, TRIAL_GAIN, gil_enabled

    if not gil_enabled():
        return Check("OK", "loader workers", "threads: this Python runs without the GIL (free-threaded), so every "
                     "decoder, Pillow's too, decodes in parallel in threads of the training process")
    gil = " (this free-threaded Python runs with the GIL: a module imported asked for it, or PYTHON_GIL=1)" \
        if sysconfig.get_config_var("Py_GIL_DISABLED") else ""
    if releases_gil("auto"):
        return Check("OK", "loader workers", f"threads up to {DEFAULT_THREADS_UP_TO} workers: the JPEG decoder "
                     f"({cpu_ops.active().split(';')[0]}) releases the GIL, so threads of the training process decode "
                     f"in parallel: no worker processes, no shared memory{gil}; processes above that (each image "
                     f"still holds the GIL for a few percent of its time), unless /dev/shm is too small for them; "
                     f"processes from the second epoch where the training step keeps its thread busy "
                     f"{STEP_PYTHON:.0%} of its time or more (its Python never pausing holds the GIL the threads "
                     f"need) and still waits for batches; where it does not wait, one epoch in processes decides "
                     f"(kept if {TRIAL_GAIN - 1:.0%} faster) (threads=True/False/'helper' or --threads "
                     f"on|off|helper chooses; num_workers=\"probe\" measures both)")
    return Check("OK", "loader workers", f"processes: the Pillow decoder holds the GIL, threads would take turns{gil}",
                 "pip install opencv-python-headless simplejpeg: its decoders release the GIL, and the workers become "
                 "threads (faster, no shared memory)")


def check_shm() -> Check:
    from fastpipe.loaders.workers import SHM, shm_free

    free = shm_free()
    if free is None:
        return Check("OK", "shared memory", f"no {SHM} (loader workers use the platform's default)")
    total = os.statvfs(SHM).f_blocks * os.statvfs(SHM).f_frsize
    found = f"{SHM}: {free / 2**20:,.0f} MB free of {total / 2**20:,.0f} MB"
    if free < 1024**3:
        return Check("WARN", "shared memory", found, "loader worker processes pass batches through it (batch 64 at "
                     "224 px is 9.6 MB, several per worker; worker threads use none): in Docker use --shm-size=2g "
                     "or --ipc=host; fastpipe lowers its processes' prefetch and count to fit, at a cost in speed")
    return Check("OK", "shared memory", found)


def check_remote() -> list[Check]:
    """Which object stores this environment can read, and whether the store endpoints it names answer."""
    from fastpipe.store.clients import installed_protocols

    have = installed_protocols()
    found = ", ".join(f"{p}://" for p, ok in have.items() if ok) or "none"
    missing = [p for p, ok in have.items() if not ok]
    checks = [Check("OK", "remote data", f"reads {found}",
                    f"for {', '.join(f'{p}://' for p in missing)}: pip install "
                    + " ".join({"s3": "s3fs", "gs": "gcsfs", "az": "adlfs", "http": "aiohttp",
                                       "hf": "'fastpipe[hf]'"}[p] for p in missing)
                    if missing else "")]
    return checks + ([_hub_token()] if have.get("hf") else []) + [_probe_endpoint(*e) for e in _endpoints()]


def _hub_token() -> Check:
    """Where hf:// requests get their token from (never the token itself)."""
    from huggingface_hub import get_token

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return Check("WARN", "hf:// token", "HF_HUB_OFFLINE is set: nothing is read from the Hub",
                     "unset HF_HUB_OFFLINE for commands that read hf:// data sets")
    source = ("HF_TOKEN" if os.environ.get("HF_TOKEN") else "the saved login (hf auth login)") if get_token() else ""
    if not source:
        return Check("OK", "hf:// token", "none: public repositories only",
                     "to read private repositories or write (shard SRC hf://...): hf auth login, or set HF_TOKEN")
    return Check("OK", "hf:// token", f"from {source}")


def check_tensorboard() -> Check:
    """Optional: with TensorBoard installed, every training run also writes event files (train/board.py)."""
    version = _dist_version("tensorboard")
    if version is None:
        return Check("OK", "tensorboard", "not installed (optional): runs keep their own records only",
                     "to see runs in TensorBoard (tensorboard --logdir runs/): pip install -e '.[tensorboard]'")
    return Check("OK", "tensorboard", f"{version}: runs also write event files (tensorboard --logdir runs/)")


def _endpoints() -> list[tuple[str, str, str]]:
    """(variable, endpoint, scheme) for each store endpoint the environment names: an S3-compatible store, a GCS
    emulator, an Azure connection string's blob endpoint (only that part of it: the string holds the key)."""
    found = []
    if os.environ.get("AWS_ENDPOINT_URL"):
        found.append(("AWS_ENDPOINT_URL", os.environ["AWS_ENDPOINT_URL"], "s3://"))
    if host := os.environ.get("STORAGE_EMULATOR_HOST"):
        found.append(("STORAGE_EMULATOR_HOST", host if "://" in host else f"http://{host}", "gs://"))
    parts = dict(p.split("=", 1) for p in os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "").split(";") if "=" in p)
    if "BlobEndpoint" in parts:
        found.append(("AZURE_STORAGE_CONNECTION_STRING", parts["BlobEndpoint"], "az://"))
    if os.environ.get("HF_ENDPOINT"):
        found.append(("HF_ENDPOINT", os.environ["HF_ENDPOINT"], "hf://"))
    return found


def _probe_endpoint(variable: str, endpoint: str, scheme: str) -> Check:
    """A store's endpoint answers any HTTP request, even a refused one: that is enough."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(endpoint, timeout=5)
    except urllib.error.HTTPError as e:  # 403 without credentials: the server is there
        return Check("OK", variable, f"{endpoint} answers (HTTP {e.code})")
    except (urllib.error.URLError, OSError) as e:
        return Check("WARN", variable, f"{endpoint} does not answer ({e})",
                     f"check the address and that the store is running; {scheme} URLs go to it")
    return Check("OK", variable, f"{endpoint} answers")


def check_ray() -> Check:
    """Ray's version and the cluster `fastpipe shard --ray` would join (Ray itself is not imported: seconds)."""
    version = _dist_version("ray")
    if version is None:
        return Check("OK", "ray", "not installed: needed only by `fastpipe shard --ray` (pip install 'fastpipe[ray]')")
    address = os.environ.get("RAY_ADDRESS", "")
    if not address:
        from fastpipe.util import usable_cores

        return Check("OK", "ray", f"{version}; RAY_ADDRESS unset: `shard --ray` starts a local cluster of "
                     f"{usable_cores()} CPUs (--ray-address joins another)")
    if address == "auto":
        return Check("OK", "ray", f"{version}; RAY_ADDRESS=auto: the cluster `ray start` started on this machine")
    from fastpipe.util import unreachable

    if problem := unreachable(address, timeout=5):
        return Check("WARN", "ray", f"{version}; RAY_ADDRESS={address}: {problem}",
                     "check the head node's address (`ray status` on the head prints it) and that it is running")
    return Check("OK", "ray", f"{version}; `shard --ray` joins the cluster at RAY_ADDRESS={address} (it answers)")


def collect() -> list[Check]:
    gpus = nvidia_smi()
    return [check_python(), *check_torch(gpus), check_driver(gpus), *check_packages(), check_dali(),
            *check_pillow(), check_decoder(), check_cpu(), check_workers(), check_shm(), *check_remote(),
            check_tensorboard(), check_ray()]


def run_doctor() -> int:
    checks = collect()
    width = max(len(c.name) for c in checks)
    for c in checks:
        said = "fix" if c.status in ("WARN", "FAIL") else "tip"  # an optional suggestion is no fix
        print(f"[{c.status:4s}] {c.name:<{width}}  {c.found}" + (f"\n{'':{width + 9}}{said}: {c.fix}" if c.fix else ""))
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"\n{len(failed)} problem(s)" if failed else "\nno problems that stop fastpipe")
    return 1 if failed else 0

#!/usr/bin/env bash
# Create .venv at the repo root (if missing) and install fastpipe with everything it needs. Each step is named with
# its size as it starts, says it is still running every 15 s, and gives its time when it ends.
#   scripts/setup.sh               torch + torchvision: the CPU build (PyTorch's CPU index) on a machine without an
#                                  NVIDIA driver, else the CUDA build; fastpipe (+ test tools); DALI for torch's CUDA
#   scripts/setup.sh --gpu         the CUDA build of torch even on a machine without an NVIDIA driver
#   scripts/setup.sh --pillow-simd also replace Pillow by pillow-simd, built from source (see README)
#   scripts/setup.sh --plan        say what it would install, and from where, and stop (installs nothing)
# FASTPIPE_TORCH_CPU_INDEX names another index of torch's CPU builds (a mirror; default PyTorch's own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_INDEX=${FASTPIPE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH=("torch==2.14.1" "torchvision==0.29.1")  # pinned where the index has them; otherwise its newest
SIMD=0 GPU=0 PLAN=0
for a in "$@"; do
  case "$a" in
    --pillow-simd) SIMD=1 ;;
    --gpu) GPU=1 ;;
    --plan) PLAN=1 ;;
    *) echo "unknown option $a (valid: --gpu, --pillow-simd, --plan)" >&2; exit 2 ;;
  esac
done

has_nvidia_driver() {  # the driver's tool on PATH, or its kernel module loaded
  command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]
}

masked() {  # a URL as pip prints one: user:****@ (a user alone may be a token: ****@), every query value ****
  local re='^([^:/?#]+://)(([^/?#]*)@)?([^?#]*)(\?[^#]*)?(#.*)?$' out auth query frag p parts=() shown=()
  if ! [[ $1 =~ $re ]]; then echo "$1"; return; fi
  out=${BASH_REMATCH[1]} auth=${BASH_REMATCH[3]} query=${BASH_REMATCH[5]#\?} frag=${BASH_REMATCH[6]}
  if [ -n "${BASH_REMATCH[2]}" ]; then
    if [[ $auth == *:* ]]; then out+="${auth%%:*}:****@"; else out+="****@"; fi
  fi
  out+=${BASH_REMATCH[4]}
  if [ -n "${BASH_REMATCH[5]}" ]; then
    IFS='&' read -ra parts <<< "$query"
    for p in ${parts[@]+"${parts[@]}"}; do
      if [[ $p == *=* ]]; then shown+=("${p%%=*}=****"); else shown+=("****"); fi  # a bare ?TOKEN is all secret
    done
    out+="?$(IFS='&'; echo "${shown[*]-}")"
  fi
  [ -z "$frag" ] || out+="#****"
  echo "$out"
}

index_problem() {  # nothing when the index answers within 5 s, else why not (pip would retry it for minutes)
  local limit=()
  command -v timeout >/dev/null && limit=(timeout 8)  # a resolver that hangs is not bound by urllib's timeout
  # The URL's user:password goes as Basic authentication, as pip sends it: in the host, urllib took the password
  # for a port. Printed: an error's reason or an OSError's text; other errors' text (InvalidURL, ValueError) may
  # quote the URL, secrets and all, so only their name.
  ${limit[@]+"${limit[@]}"} "$PY" -c 'import base64, sys, urllib.parse, urllib.request
url = urllib.parse.urlsplit(sys.argv[1].rstrip("/") + "/")
auth, _, host = url.netloc.rpartition("@")
request = urllib.request.Request(url._replace(netloc=host).geturl())
if auth:
    request.add_header("Authorization", "Basic " + base64.b64encode(urllib.parse.unquote(auth).encode()).decode())
try:
    urllib.request.urlopen(request, timeout=5).close()
except Exception as e:
    print(getattr(e, "reason", None) or (e if isinstance(e, OSError) else type(e).__name__))' "$1" 2>/dev/null \
    || echo "no answer within 5 s"
}
CPU_SHOWN=$(masked "$CPU_INDEX")  # what is printed of the index: never its password or a query's token

step() {  # step WHAT COMMAND...: names the step, says it is still running every 15 s, then how long it took
  local what=$1 t0=$SECONDS rc=0 beat
  shift
  if [ "$PLAN" = 1 ]; then echo "  would install: $what"; return 0; fi
  echo "==> $what ..."
  ( while sleep 15; do echo "    ... $((SECONDS - t0)) s: $what"; done ) &
  beat=$!
  "$@" || rc=$?
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null || true
  if [ "$rc" = 0 ]; then echo "    done in $((SECONDS - t0)) s: $what"
  else echo "    FAILED after $((SECONDS - t0)) s: $what" >&2; fi
  return "$rc"
}

pip_shown() {  # pip's output less a line per package already there and the editable build's steps; a large
  # download's progress as a line per 10 %
  awk '/^Requirement already satisfied/ { next }
       /^  (Installing build dependencies|Checking if build backend|Getting requirements to build|Preparing (editable )?metadata|Building (editable|wheel) for|Created wheel for|Stored in directory)/ { next }
       /^Progress [0-9]+ of [0-9]+$/ { if ($4 >= 20e6 && int(10 * $2 / $4) != last) { last = int(10 * $2 / $4)
                                         printf "      %.0f of %.0f MB\n", $2 / 1e6, $4 / 1e6; fflush() }
                                       next }
       { last = -1; print; fflush() }'
}
pip() { .venv/bin/python -m pip "$@"; }
pip_install() { pip install --progress-bar raw "$@" 2>&1 | pip_shown; }
torch_from() { pip_install "$@" "${TORCH[@]}" || pip_install "$@" torch torchvision; }

# Which torch: a CUDA build where there is an NVIDIA driver (or --gpu), else the CPU build (~200 MB instead of ~3 GB
# with its CUDA libraries), from PyTorch's CPU index when it answers, else from the default index, saying so.
TORCH_FROM=()
if [ "$GPU" = 1 ]; then
  echo "machine: --gpu given: torch's CUDA build"
  TORCH_WHAT="torch + torchvision, CUDA build (~3 GB with its CUDA libraries)"
elif has_nvidia_driver; then
  echo "machine: an NVIDIA driver is installed: torch's CUDA build"
  TORCH_WHAT="torch + torchvision, CUDA build (~3 GB with its CUDA libraries)"
elif problem=$(index_problem "$CPU_INDEX") && [ -z "$problem" ]; then
  echo "machine: no NVIDIA driver (no nvidia-smi, no /proc/driver/nvidia): torch's CPU build (--gpu for the CUDA one)"
  TORCH_FROM=(--index-url "$CPU_INDEX")
  TORCH_WHAT="torch + torchvision, CPU build (~200 MB) from $CPU_SHOWN"
else
  echo "machine: no NVIDIA driver (no nvidia-smi, no /proc/driver/nvidia), but $CPU_SHOWN did not answer" \
       "($problem): falling back to the default index, whose torch may be the CUDA build (~3 GB with its CUDA" \
       "libraries)"
  TORCH_WHAT="torch + torchvision from the default index"
fi

if [ "$PLAN" = 0 ]; then
  [ -x .venv/bin/python ] || step "a virtual environment in .venv" "$PY" -m venv .venv
  step "the latest pip (~2 MB)" pip install -q --upgrade pip
fi
VPY=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo "$PY")

if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  have=$(.venv/bin/python -c "import torch; print(torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build')")
  echo "torch $have already in .venv: kept (pip uninstall torch torchvision, then rerun, for another build)"
elif [ ${#TORCH_FROM[@]} -gt 0 ]; then
  step "$TORCH_WHAT" torch_from "${TORCH_FROM[@]}" || {
    echo "$CPU_SHOWN failed: falling back to the default index"
    step "torch + torchvision from the default index" torch_from
  }
else
  step "$TORCH_WHAT" torch_from
fi

# The crop-aware JPEG decoder (fastpipe/_jpegcrop.c, built by the install below) needs a C compiler, Python's and
# libjpeg-turbo's headers: installed here where missing (Debian: libjpeg62-turbo-dev; Ubuntu: libjpeg-dev). Without
# them fastpipe installs all the same and decodes whole images, as `fastpipe doctor` then says.
need=()
[ -e /usr/include/jpeglib.h ] || need+=(libjpeg62-turbo-dev)
command -v cc >/dev/null || need+=(gcc)
[ -e "$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ] || need+=(python3-dev)
apt_install() {  # a fresh machine may have no package lists yet: fetch them once, then try again
  apt-get install -y -q "$@" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1; }
}
apt_packages() { apt_install "${need[@]}" || apt_install "${need[@]/libjpeg62-turbo-dev/libjpeg-dev}"; }
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  step "${need[*]} from apt (for the crop-aware JPEG decoder)" apt_packages \
    || echo "WARN: could not install ${need[*]}; fastpipe's crop-aware JPEG decoder will not be built"
fi
step "fastpipe and its test tools (pip install -e '.[test]'; ~350 MB on a fresh machine: Ray, pyarrow, OpenCV, moto...)" \
  pip_install -e ".[test]"
# The clone's folder on the import path: a script run from the folder that holds the clone would otherwise import
# the clone (a folder named fastpipe, no __init__.py) as an empty namespace package before the editable install's
# finder is asked ("cannot import name 'Predictor' from 'fastpipe' (unknown location)").
if [ "$PLAN" = 0 ]; then
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  printf '%s\n' "$PWD" > "$site/fastpipe-source.pth"
fi

# DALI whose CUDA major matches torch's (torch 2.14.1 is a cu130 build → nvidia-dali-cuda130). Kept on a machine
# without a GPU too: its CPU pipeline is one of the loader backends, and the tests run it.
major=$([ "$PLAN" = 0 ] && .venv/bin/python -c "import torch; print((torch.version.cuda or '13').split('.')[0])" || echo 13)
case "$major" in
  12) step "DALI for CUDA 12 (nvidia-dali-cuda120, ~270 MB with its libraries)" pip_install -e ".[dali]" \
        || echo "WARN: DALI (cuda120) not installed; dali tests will skip" ;;
  *)  step "DALI for CUDA 13 (nvidia-dali-cuda130, ~270 MB with its libraries)" pip_install -e ".[dali-cu13]" \
        || echo "WARN: DALI (cuda130) not installed; dali tests will skip" ;;
esac

# Azurite, Microsoft's Azure Storage server, for tests/test_stores.py (a Node.js program: npm, not pip).
if command -v npm >/dev/null && [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
  step "Azurite for the Azure tests (npm, ~190 MB on disk)" \
    npm install --prefix .tools/azurite --no-audit --no-fund --silent azurite@3 \
    || echo "WARN: Azurite not installed; the Azure tests will skip"
fi

simd() {
  # pillow-simd replaces Pillow in the same PIL/ folder and builds from source. The format headers keep
  # WebP/TIFF/ICC photos readable; --no-deps --force-reinstall last, so nothing puts Pillow back.
  if command -v apt-get >/dev/null; then
    apt-get install -y -q libjpeg62-turbo-dev zlib1g-dev libwebp-dev libtiff-dev liblcms2-dev libfreetype-dev \
      >/dev/null 2>&1 || apt-get install -y -q libjpeg-dev zlib1g-dev >/dev/null
  fi
  pip uninstall -y -q pillow pillow-simd || true
  CC="cc -mavx2" pip_install --force-reinstall --no-deps --no-binary :all: pillow-simd
}
if [ "$SIMD" = 1 ]; then
  step "pillow-simd, built from source (~60 s)" simd
  [ "$PLAN" = 1 ] || .venv/bin/python -c "import PIL; print('PIL', PIL.__version__)"
fi
[ "$PLAN" = 1 ] && exit 0
.venv/bin/python -c "import fastpipe, torch; print('fastpipe', fastpipe.__version__, '| torch', torch.__version__)"
.venv/bin/python -c "from fastpipe.loaders import cpu_ops; print('JPEG decoder:', cpu_ops.active())"

#!/usr/bin/env bash
# Create .venv at the repo root (if missing) and install fastpipe with everything it needs.
#   scripts/setup.sh               torch, torchvision, fastpipe (+ test tools), DALI for torch's CUDA major
#   scripts/setup.sh --pillow-simd also replace Pillow by pillow-simd, built from source (see README)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIMD=0
for a in "$@"; do
  case "$a" in
    --pillow-simd) SIMD=1 ;;
    *) echo "unknown option $a (valid: --pillow-simd)" >&2; exit 2 ;;
  esac
done

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip

# torch 2.14.1 / torchvision 0.29.1 are pinned when pip can get them; otherwise pip fetches the newest build.
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  pip install -q "torch==2.14.1" "torchvision==0.29.1" || pip install -q torch torchvision
fi
# The crop-aware JPEG decoder (fastpipe/_jpegcrop.c, built by the install below) needs a C compiler, Python's and
# libjpeg-turbo's headers: installed here where missing (Debian: libjpeg62-turbo-dev; Ubuntu: libjpeg-dev). Without
# them fastpipe installs all the same and decodes whole images, as `fastpipe doctor` then says.
need=()
[ -e /usr/include/jpeglib.h ] || need+=(libjpeg62-turbo-dev)
command -v cc >/dev/null || need+=(gcc)
[ -e "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ] || need+=(python3-dev)
apt_install() {  # a fresh machine may have no package lists yet: fetch them once, then try again
  apt-get install -y -q "$@" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1; }
}
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  apt_install "${need[@]}" || apt_install "${need[@]/libjpeg62-turbo-dev/libjpeg-dev}" \
    || echo "WARN: could not install ${need[*]}; fastpipe's crop-aware JPEG decoder will not be built"
fi
pip install -q -e ".[test]"

# DALI whose CUDA major matches torch's (torch 2.14.1 is a cu130 build → nvidia-dali-cuda130).
major=$(.venv/bin/python -c "import torch; print((torch.version.cuda or '13').split('.')[0])")
case "$major" in
  12) pip install -q -e ".[dali]" || echo "WARN: DALI (cuda120) not installed; dali tests will skip" ;;
  *)  pip install -q -e ".[dali-cu13]" || echo "WARN: DALI (cuda130) not installed; dali tests will skip" ;;
esac

# Azurite, Microsoft's Azure Storage server, for tests/test_stores.py (a Node.js program: npm, not pip).
if command -v npm >/dev/null && [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
  npm install --prefix .tools/azurite --no-audit --no-fund --silent azurite@3 \
    || echo "WARN: Azurite not installed; the Azure tests will skip"
fi

if [ "$SIMD" = 1 ]; then
  # pillow-simd replaces Pillow in the same PIL/ folder and builds from source (~60 s). The format headers
  # keep WebP/TIFF/ICC photos readable; --no-deps --force-reinstall last, so nothing puts Pillow back.
  if command -v apt-get >/dev/null; then
    apt-get install -y -q libjpeg62-turbo-dev zlib1g-dev libwebp-dev libtiff-dev liblcms2-dev libfreetype-dev \
      >/dev/null 2>&1 || apt-get install -y -q libjpeg-dev zlib1g-dev >/dev/null
  fi
  pip uninstall -y -q pillow pillow-simd || true
  CC="cc -mavx2" pip install -q --force-reinstall --no-deps --no-binary :all: pillow-simd
  .venv/bin/python -c "import PIL; print('PIL', PIL.__version__)"
fi
.venv/bin/python -c "import fastpipe, torch; print('fastpipe', fastpipe.__version__, '| torch', torch.__version__)"
.venv/bin/python -c "from fastpipe.loaders import cpu_ops; print('JPEG decoder:', cpu_ops.active())"

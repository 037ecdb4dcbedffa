#!/usr/bin/env bash
# On a machine with network access: fetch the small wheels that an offline GPU machine may lack (webdataset,
# braceexpand, simplejpeg) into .whl/ (git-ignored), for scripts/gpu_check.sh to install there. DALI is not fetched
# (it is large); where it is missing, gpu_check.sh skips its checks and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl webdataset braceexpand simplejpeg
ls -la .whl

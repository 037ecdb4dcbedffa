#!/usr/bin/env bash
# The peer comparison's own environment (benchmarks/bench_peers.py): .peers/, a venv that sees fastpipe's .venv
# (torch, webdataset, simplejpeg: one copy, the same versions) and adds litdata and Mosaic streaming, which are
# never fastpipe's dependencies. Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run scripts/setup.sh first (.venv is missing)"; exit 1; }
python3 -m venv .peers
SITE=$(.peers/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VENV_SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n' "$VENV_SITE" "$PWD" > "$SITE/fastpipe-venv.pth"
.peers/bin/pip install -q "litdata==0.2.76" "mosaicml-streaming==0.13.0"
.peers/bin/python -c "import litdata, streaming, fastpipe; print('peers ready: litdata', litdata.__version__, 'streaming', streaming.__version__)"

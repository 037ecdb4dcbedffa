#!/usr/bin/env bash
# GPU checks in one go, within GPU_CHECK_SECONDS (default 540 s; each step gets at most what is left): the
# gpu-marked tests, then `fastpipe bench` on demo data for resnet18 and resnet50 with the torch, nvjpeg and DALI
# backends, the loader benchmark, reading from a store with 2 workers (cores to spare), the cost of each device
# augmentation against a ResNet-50 fp16 step at batch 256 (target: under 5 %), `fastpipe memory`'s predictions
# against measured peaks, and a memory report.
#   scripts/gpu_check.sh OUTDIR
# Writes into OUTDIR: log.txt (everything, with a summary at the end), bench-resnet18.{json,png},
# bench-resnet50.{json,png}, loaders.{json,png}, remote-2workers.{json,png}, augment.{json,png}, memory-vs-measured.{json,png}, memory.json, and
# all of them packed in results.tgz (one file to copy off the machine). Works with the machine's
# own python3 and PYTHONPATH=. (no .venv needed); wheels in .whl/ (scripts/gpu_wheels.sh) are installed first when present.
# What is missing (DALI, webdataset, pytest) is skipped with the reason in the log, never silently.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/log.txt"
: > "$LOG"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 FASTPIPE_CACHE=/tmp/fastpipe-cache
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/fp-site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/fp-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()
note() { echo "$*" | tee -a "$LOG"; SUMMARY+=("$*"); }
mark() { wc -l < "$LOG"; }  # a step's summary greps only the lines the step wrote
since() { tail -n +$(( $1 + 1 )) "$LOG" | grep -E "$2" | tail -1; }
has() { $PY -c "import $1" 2>/dev/null; }
# The whole script stays within GPU_CHECK_SECONDS (default 540 s):
# each step gets at most what is left, and a step with under 15 s left is skipped, saying so.
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-540} ))
run() {
  local t=$1 left=$(( DEADLINE - $(date +%s) )); shift
  if [ "$left" -lt 15 ]; then echo "SKIP (time budget spent): $*" | tee -a "$LOG"; return 124; fi
  [ "$left" -lt "$t" ] && t=$left
  echo "\$ $*" >>"$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1
}

note "== $(date -u +%FT%TZ) $($PY -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())')"
run 60 $PY -m fastpipe doctor
has nvidia.dali || note "SKIP DALI rows: nvidia.dali is not installed here (the dali rows say 'skipped' in the JSON)"
has webdataset || note "SKIP webdataset-only tests and the docs-pipeline baseline: webdataset is not installed here"

# 1. gpu-marked tests
if has pytest; then
  m=$(mark); run 240 $PY -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/; rc=$?
  note "gpu tests: exit $rc ($(since "$m" '(passed|failed|skipped|error)'))"
else
  note "SKIP gpu tests: pytest is not installed here"
fi

# 2. demo data at full resolution, converted once (16 cores: about a minute); small shards, so that each of the
# loader benchmark's 8 workers has one (webdataset's own pipeline fails with fewer shards than workers)
DATA=/tmp/fp-gpu
if [ ! -f "$DATA/shards/dataset.json" ]; then
  run 200 $PY -m fastpipe demo-data "$DATA/raw" --count 400 && \
  run 120 $PY -m fastpipe shard "$DATA/raw" "$DATA/shards" --max-shard-size 512KB
fi
note "shards: $($PY -c "from fastpipe.dataset.manifest import load; m=load('$DATA/shards'); print({k: v.samples for k, v in m.splits.items()})" 2>&1)"

# 3. loader or GPU? resnet18 and resnet50, every backend
for model in resnet18 resnet50; do
  m=$(mark); run 150 $PY -m fastpipe bench "$DATA/shards" --model "$model" --backend torch,nvjpeg,dali \
    --batch-size 128 --steps 15 --json "$OUT/bench-$model.json" --plot "$OUT/bench-$model.png"
  note "bench $model: exit $? $(since "$m" '(loader-bound|device-bound|balanced|disturbed|not measured):')"
done

# 4. loaders alone (GPU rows included) and the memory report
ONLY=""; has webdataset || ONLY="--only fastpipe"
run 120 $PY benchmarks/bench_loaders.py --shards "$DATA/shards" --workers 8 --window-images 4096 $ONLY \
  --json "$OUT/loaders.json" --plot "$OUT/loaders.png"
note "loader benchmark: exit $?"
# reading from a store over loopback HTTP at 20 ms a request, 2 workers, with cores to spare for the reading path
# (target: 0.9 of the local disk's rate or more)
run 150 $PY benchmarks/bench_remote.py --shards "$DATA/shards" --workers 2 --latency 20 --rounds 2 \
  --json "$OUT/remote-2workers.json" --plot "$OUT/remote-2workers.png"
note "remote reading, 2 workers at 20 ms: exit $? $($PY -c "import json; r=json.load(open('$OUT/remote-2workers.json')); print('; '.join(f\"{x['source']} {x['img_per_s_vs_local']:.2f} of local (steady {x['steady_img_per_s_vs_local']:.2f})\" for x in r['rows']))" 2>&1 | head -c 300)"
run 120 $PY benchmarks/bench_augment.py --json "$OUT/augment.json" --plot "$OUT/augment.png"
note "augmentation cost: exit $? $($PY -c "import json; r=json.load(open('$OUT/augment.json')); print('; '.join(f\"{x['augment']} {x['share_of_step']:.1%}\" for x in r['rows'][1:]))" 2>&1)"
m=$(mark); run 150 $PY benchmarks/bench_memory.py --models resnet18,resnet50,convnext_tiny,vit_b_16 --amp fp16,off \
  --json "$OUT/memory-vs-measured.json" --plot "$OUT/memory-vs-measured.png"
note "memory predicted vs measured: exit $? ($(grep -c 'b=' <(tail -n +$((m + 1)) "$LOG")) rows)"
run 90 $PY -m fastpipe memory --model resnet50 --batch-size 128 --amp fp16 --gpu-memory 8GB --json "$OUT/memory.json"
note "memory report: exit $?"

echo "== summary" >>"$LOG"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG" >/dev/null
# written beside OUT, then moved in: an archive growing inside the folder it reads makes tar fail
PACK=$(mktemp) && tar czf "$PACK" -C "$OUT" . 2>>"$LOG" && mv "$PACK" "$OUT/results.tgz"
echo "results in $OUT"

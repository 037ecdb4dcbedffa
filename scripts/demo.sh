#!/usr/bin/env bash
# The whole main job on a fresh machine: set up, make demo photos, shard them, then (as they exist) bench and
# train on them. Everything lands under demo/ (ignored by git). DEMO_COUNT=N for more or fewer photos.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
FP=".venv/bin/fastpipe"
COUNT=${DEMO_COUNT:-180}

echo "== environment"
$FP doctor || true
echo "== demo photos ($COUNT at 3264x2448)"
[ -f demo/raw/.done ] || { $FP demo-data demo/raw --count "$COUNT" && touch demo/raw/.done; }
echo "== shard once"
$FP shard demo/raw demo/shards --max-shard-size 2MB
$FP inspect demo/shards
echo "previews: demo/shards/previews/*.jpg   rejections: demo/shards/rejected.jsonl"

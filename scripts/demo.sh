#!/usr/bin/env bash
# The whole main job on a fresh machine: set up, make demo photos, shard them once, ask "loader or GPU?",
# train briefly, then predict with the trained model and export it. Everything lands under demo/ (ignored by git).
# On a 2-core x86-64 VM without a GPU, with the environment already set up: 143 s in all (setup check included).
#   DEMO_COUNT=N   photos to generate (default 180)      DEMO_EPOCHS=N  training epochs (default 6)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
FP=".venv/bin/fastpipe"
COUNT=${DEMO_COUNT:-180}
EPOCHS=${DEMO_EPOCHS:-6}
# Small images on a CPU so that the demo stays short; on a GPU the defaults (224) are the real thing.
SIZE=$(.venv/bin/python -c "import torch; print(224 if torch.cuda.is_available() else 96)")

echo "== 1. environment"
$FP doctor || true

echo "== 2. demo photos ($COUNT at 3264x2448: leaves and pipelines, 20:1 imbalance, a few broken files)"
[ -f demo/raw/.done ] || { rm -rf demo/raw; $FP demo-data demo/raw --count "$COUNT" && touch demo/raw/.done; }

echo "== 3. shard once"
$FP shard demo/raw demo/shards --max-shard-size 2MB
$FP inspect demo/shards
echo "previews: demo/shards/previews/*.jpg   rejections: demo/shards/rejected.jsonl"

echo "== 4. loader or device? (fastpipe bench)"
$FP bench demo/shards --model resnet18 --batch-size 32 --image-size "$SIZE" --steps 4 --windows 2 \
  --json demo/bench.json --plot demo/bench.png

echo "== 5. train (fastpipe train)"
rm -rf demo/runs/demo
$FP train demo/shards --model resnet18 --epochs "$EPOCHS" --batch-size 16 --image-size "$SIZE" \
  --optimizer adamw --lr 1e-3 --out demo/runs/demo
$FP runs demo/runs
echo "run folder: demo/runs/demo (config.json, metrics.jsonl, summary.json, curves.png, confusion.png)"

echo "== 6. use the trained model (fastpipe predict, fastpipe export)"
$FP predict demo/runs/demo demo/raw --out demo/predictions.csv
$FP export demo/runs/demo demo/model.pt2
echo "predictions: demo/predictions.csv (report and pictures beside it)   exported: demo/model.pt2 (+ .json)"

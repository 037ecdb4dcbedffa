#!/usr/bin/env bash
# The test command (README, CI): set up .venv, lint, run pytest.
#   scripts/test.sh              the default tests (the slow ones skipped)
#   scripts/test.sh --all        every test, the slow ones too (real training processes interrupted, killed or run
#                                under torchrun; Ray's worker restarts; Ray Data): what CI runs
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then args+=(-m "slow or not slow"); else args+=("$a"); fi
done
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest ${args[@]+"${args[@]}"}

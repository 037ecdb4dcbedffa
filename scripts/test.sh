#!/usr/bin/env bash
# The test command (README, CI): set up .venv, lint, run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up .venv, runs the linter
# (ruff) and the type checker (mypy), then pytest; fails on the first that fails.
# Extra arguments go to pytest (e.g. `bash tools/run_tests.sh -k store -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
VENV=${ECSTORE_VENV:-.venv}
echo "[check] ruff check . (lint, config in pyproject.toml)" >&2
"$VENV/bin/python" -m ruff check .
echo "[check] mypy (types of the ecstore package, config in pyproject.toml)" >&2
"$VENV/bin/python" -m mypy
exec "$VENV/bin/python" -m pytest "$@"

#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up .venv, then runs pytest.
# Extra arguments go to pytest (e.g. `bash tools/run_tests.sh -k store -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
VENV=${ECSTORE_VENV:-.venv}
exec "$VENV/bin/python" -m pytest "$@"

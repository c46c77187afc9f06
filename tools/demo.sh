#!/usr/bin/env bash
# The main job, from a fresh machine: sets up .venv, then runs the demo.
# Arguments go to the demo; `--video` first runs the video benchmark (tools/demo_video.py) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
VENV=${ECSTORE_VENV:-.venv}
if [ "${1:-}" = "--video" ]; then   # the spec's video benchmark in miniature (tools/demo_video.py)
  shift
  exec "$VENV/bin/python" tools/demo_video.py "$@"
fi
if [ -f tools/demo.py ]; then
  exec "$VENV/bin/python" tools/demo.py "$@"
fi
exec "$VENV/bin/python" tools/store_demo.py "$@"

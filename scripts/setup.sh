#!/usr/bin/env bash
# Sets up a development environment on a fresh machine: Python dependencies (installed once into the
# interpreter's own site-packages, so torch is downloaded once per machine, not once per checkout),
# a virtualenv that sees them, and the Rust extension built into it with `maturin develop`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# Everything the tests and the engine import. pip skips what is already satisfied, so a machine that
# already has torch never downloads it again.
DEPS=(numpy pytest hypothesis ruff maturin torch safetensors tqdm transformers matplotlib
      fastapi uvicorn uvloop httptools pydantic prometheus_client aiohttp httpx openai)
missing=()
for dep in "${DEPS[@]}"; do
    if ! "$PYTHON" -m pip show -q "$dep" >/dev/null 2>&1; then missing+=("$dep"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
maturin develop --release -q >/dev/null 2>&1 || maturin develop --release
python -c "import hybrid_cache._core" || { echo "setup: extension failed to build"; exit 1; }

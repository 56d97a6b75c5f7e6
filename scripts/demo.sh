#!/usr/bin/env bash
# The main job: sets everything up, then runs an allocator demo on a Gemma-2-shaped model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
python -m hybrid_cache.demo "$@"

#!/usr/bin/env bash
# The main job: sets everything up, then generates with the engine on a small built-in model
# (tiny-gemma3: 5 local : 1 global layers, random weights) with the hybrid allocator.
# Extra arguments go to `hybrid-cache generate` (see `hybrid-cache generate --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
hybrid-cache generate --model tiny-gemma3 --max-tokens 64 --ignore-eos "$@"

#!/usr/bin/env bash
# Runs `hybrid-cache bench ARGS` on another checkout, then on this one, PAIRS times in turn, and
# prints each run's total tokens/s and engine overhead at its largest batch: a change against
# the code before it, measured side by side on this noisy machine (report ratios per pair).
#
#   git worktree add /tmp/before REV
#   scripts/bench_pairs.sh /tmp/before 5 --model tiny-llama --input-len 512 --output-len 128 \
#       --num-prompts 64 --kv-cache-memory 64MiB --kv-cache-mode hybrid --num-threads 1
#
# The other checkout runs with its own Rust extension: built once into its python/ folder
# (maturin build, the wheel's _core unpacked there) when it has none. Uses this shell's python.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 OTHER_CHECKOUT PAIRS [hybrid-cache bench arguments]" >&2
    exit 2
fi
other=$(cd "$1" && pwd)
pairs=$2
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
if ! compgen -G "$other/python/hybrid_cache/_core*.so" >/dev/null; then
    wheels=$(mktemp -d)
    (cd "$other" && CARGO_TARGET_DIR="$wheels/target" maturin build --release -q -o "$wheels")
    python -c "import glob, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0])
for name in wheel.namelist():
    if name.startswith('hybrid_cache/_core'):
        wheel.extract(name, sys.argv[2])" "$wheels" "$other/python"
    rm -rf "$wheels"
fi
for _ in $(seq "$pairs"); do
    for side in other here; do
        root=$other
        [ "$side" = here ] && root=$here
        out=$(PYTHONPATH="$root/python" python -m hybrid_cache bench "$@" 2>&1)
        tokens=$(grep -oE '[0-9.]+ total tokens/s' <<<"$out" | head -1)
        overhead=$(grep -oE '[0-9.]+% of steps with [0-9]+ requests' <<<"$out" | head -1)
        echo "$side: $tokens; overhead ${overhead:-not timed}"
    done
done

#!/usr/bin/env bash
# GPU checks and benchmarks, one CUDA GPU, about ten minutes (BENCHMARKS.md's GPU section):
#   1. the Triton kernels against the torch reference at realistic sizes, then their timings
#      against SDPA and flash-attn (scripts/gpu_check.py);
#   2. the whole engine on CUDA against the same engine on the CPU, token for token
#      (scripts/gpu_engine_check.py);
#   3. throughput, hybrid vs uniform, of a real-size preset with dummy weights (gemma-3-12b,
#      bf16, 32 prompts of 4096 tokens, 256 out, a KV budget where uniform holds 8 at once);
#   4. the CPU benchmark's tiny-preset workload on the GPU.
# Needs `hybrid_cache` importable by $PYTHON (default python3): `maturin develop --release`.
# Hybrid and uniform alternate twice and each mode's faster run counts (`--repeat 2`): the first
# run of a mode also pays Triton's compiles of the kernel variants it meets.
# Usage: scripts/bench_gpu.sh [OUT_DIR [STAGES]]   (log: OUT_DIR/gpu.log, figures: OUT_DIR/*.json;
# STAGES: any of "kernels engine gemma-3-12b tiny", default all)
set -uo pipefail
out=${1:-bench-gpu}
stages=" ${2:-kernels engine gemma-3-12b tiny} "
mkdir -p "$out"
log="$out/gpu.log"
status=0
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, keep going on failure
    local name=$1 limit=$2 started rc
    shift 2
    echo "== $name: $*" | tee -a "$log"
    started=$(date +%s)
    timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "^INFO\|it/s\]$\|req/s\]$" | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $(($(date +%s) - started)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
want() { [[ $stages == *" $1 "* ]]; }
want kernels && stage kernels 150 "$py" scripts/gpu_check.py
want engine && stage engine-vs-cpu 110 "$py" scripts/gpu_engine_check.py
want gemma-3-12b && stage gemma-3-12b 330 "$py" -m hybrid_cache bench --model gemma-3-12b \
    --input-len 4096 --output-len 256 --num-prompts 32 --kv-cache-memory 13.5GiB \
    --kv-cache-mode both --repeat 2 --output-json "$out/gemma-3-12b.json" \
    --plot "$out/gemma-3-12b.png"
for run in "tiny-gemma2 10.25MiB" "tiny-gemma3 15.25MiB" "tiny-llama 10.25MiB"; do
    set -- $run
    want tiny && stage "$1" 60 "$py" -m hybrid_cache bench --model "$1" --kv-cache-memory "$2" \
        --input-len 512 --output-len 128 --num-prompts 64 --kv-cache-mode both --repeat 2 \
        --output-json "$out/$1.json"
done
exit $status

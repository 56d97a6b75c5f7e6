#!/usr/bin/env bash
# GPU checks and benchmarks on one CUDA GPU in one prepared run of at most ~8 minutes
# (BENCHMARKS.md's GPU section):
#   0. build: `maturin develop --release` only if `hybrid_cache` does not import;
#   1. kernels: the Triton kernels against the torch reference at realistic sizes, windows far
#      shorter than the context with many KV splits among them, then their timings (eager and
#      replayed from a CUDA graph) against SDPA, flash-attn and the measured copy bandwidth
#      (scripts/gpu_check.py);
#   2. engine-vs-cpu: the whole engine on CUDA against the same engine on the CPU, token for
#      token, and a tail replay on CUDA against a cold CPU engine (scripts/gpu_engine_check.py);
#   3. engine-timing: gemma-3-12b (bf16 dummy weights, 32 prompts x 4096 in / 128 out), hybrid,
#      two runs: each run's warm-up (the Triton compiles) apart from its timed run, first run
#      over second, and a pure-decode step against reading the weights and visible KV once at
#      the copy bandwidth, that step split into forward (and the host's time issuing it), LM head
#      and engine time (scripts/gpu_engine_timing.py).
# Not in the default stages (add them by name; each needs its own minutes):
#   gemma-3-12b  hybrid vs uniform throughput, --repeat 2 (about 5 minutes);
#   tiny         the CPU benchmark's tiny-preset workload on the GPU (about 3 minutes);
#   bf16         our engine in bf16 against transformers in bf16, both from transformers' float32, on
#                tiny seeded models of every architecture (scripts/gpu_bf16_check.py; about 1 minute);
#   anatomy      where a gemma-3-12b pure-decode forward spends its time: launches or kernels
#                (the device set spinning while the host issues it; aten ops counted; about 2
#                minutes; scripts/gpu_decode_anatomy.py).
# Usage: scripts/bench_gpu.sh [OUT_DIR [STAGES]]   (log: OUT_DIR/gpu.log, figures: OUT_DIR/*.json;
# STAGES: any of "build kernels engine timing bf16 anatomy gemma-3-12b tiny", default
# "build kernels engine timing"). PYTHON picks the interpreter (default python3).
# `DRY_RUN=1 scripts/bench_gpu.sh OUT` runs every default stage's script on the CPU with tiny
# shapes (their --cpu-dry-run), to check the script itself.
set -uo pipefail
out=${1:-bench-gpu}
stages=" ${2:-build kernels engine timing} "
mkdir -p "$out"
log="$out/gpu.log"
status=0
py=${PYTHON:-python3}
dry=()
[ "${DRY_RUN:-0}" = 1 ] && dry=(--cpu-dry-run)
export PYTHONUNBUFFERED=1
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, keep going on failure
    local name=$1 limit=$2 started rc
    shift 2
    [ ${#dry[@]} -eq 0 ] || limit=$((limit * 4))  # the CPU interpreter is slow
    echo "== $name: $*" | tee -a "$log"
    started=$(date +%s)
    timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "^INFO\|it/s\]$\|req/s\]$" | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $(($(date +%s) - started)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true; } 2>&1 | tee -a "$log"
want() { [[ $stages == *" $1 "* ]]; }
# Time limits (seconds) add up to 500 with a build, 400 without.
want build && stage build 100 bash -c "\"$py\" -c 'import hybrid_cache._core' 2>/dev/null \
    && echo 'hybrid_cache imports: no build needed' || \"$py\" -m maturin develop --release -q"
want kernels && stage kernels 130 "$py" scripts/gpu_check.py "${dry[@]}"
want engine && stage engine-vs-cpu 100 "$py" scripts/gpu_engine_check.py "${dry[@]}"
want timing && stage engine-timing 170 "$py" scripts/gpu_engine_timing.py "${dry[@]}" \
    --output-json "$out/engine-timing.json"
want bf16 && stage bf16 200 "$py" scripts/gpu_bf16_check.py "${dry[@]}" \
    --output-json "$out/bf16.json"
want anatomy && stage anatomy 200 "$py" scripts/gpu_decode_anatomy.py "${dry[@]}" \
    --output-json "$out/anatomy.json"
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

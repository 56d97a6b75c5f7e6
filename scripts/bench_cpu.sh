#!/usr/bin/env bash
# CPU benchmarks of BENCHMARKS.md: hybrid vs uniform on the tiny presets, engine
# overhead at 64 running requests, ours vs transformers' generate_batch. One run at a time.
# Workload: 64 prompts of 512 tokens, 128 generated each (windows of the tiny presets: 16);
# KV budget: the uniform allocator holds 16 = a quarter of the prompts at 512+128 tokens.
# Timings on a shared machine are noisy: both engines run side by side in one process, time
# slices by turns (`--interleave`), 5 times; the fastest run per mode counts, and the median of
# the 5 side-by-side pairs is printed too.
# Usage: scripts/bench_cpu.sh [OUT_DIR]   (figures: OUT_DIR/*.json, plots: OUT_DIR/*.png,
# the noise floor: OUT_DIR/noise-floor.txt, what grouping costs: OUT_DIR/hybrid-cost.txt)
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"
common=(--input-len 512 --output-len 128 --num-prompts 64 --kv-cache-mode both --num-threads 1 --repeat 5 --interleave)
for run in "tiny-gemma2 10.25MiB" "tiny-gemma3 15.25MiB" "tiny-llama 10.25MiB"; do
    set -- $run
    hybrid-cache bench --model "$1" --kv-cache-memory "$2" "${common[@]}" \
        --output-json "$out/$1.json" --plot "$out/$1.png"
done
# Engine overhead: 64 requests running together (budget for all of them).
hybrid-cache bench --model tiny-llama --input-len 512 --output-len 128 --num-prompts 64 \
    --kv-cache-memory 64MiB --kv-cache-mode hybrid --num-threads 1 --output-json "$out/overhead.json"
# Ours vs transformers' continuous batching (same weights, prompts, greedy).
hybrid-cache bench --model tiny-gemma2 --input-len 512 --output-len 128 --num-prompts 64 \
    --kv-cache-memory 64MiB --kv-cache-mode hybrid --num-threads 1 --compare-hf \
    --output-json "$out/vs-hf.json"
# The noise floor of the ratios above, in the same run: one mode against itself, side by side.
python "$(dirname "$0")/bench_noise_floor.py" --repeat 5 | tee "$out/noise-floor.txt"
# What grouping costs hybrid (tiny-gemma3): against a uniform engine given the memory to run
# hybrid's schedule, side by side with the uniform engine of the real budget.
python "$(dirname "$0")/bench_hybrid_cost.py" --repeat 4 | tee "$out/hybrid-cost.txt"

#!/usr/bin/env bash
# Runs the coordinator fuzz target (fuzz/fuzz_targets/coordinator_ops.rs) for SECONDS
# (default 60) in one process, after replaying the corpus. Exits non-zero, with the crashing input and the
# command to reproduce it, when libFuzzer finds a crash, a panic (a broken invariant) or a leak.
#
#   scripts/fuzz.sh            # 60 s (CI runs 30 s: FUZZ_SECONDS in scripts/test.sh)
#   scripts/fuzz.sh 900        # a long run
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). Uses the nightly toolchain when rustup has one;
# otherwise stable with RUSTC_BOOTSTRAP=1 (cargo-fuzz passes nightly-only -Z flags).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

SECONDS_TO_RUN="${1:-60}"
TARGET=coordinator_ops
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "fuzz.sh: cargo-fuzz is not installed; run: cargo install cargo-fuzz" >&2
    exit 2
fi
TOOLCHAIN=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    TOOLCHAIN=(+nightly)
else
    export RUSTC_BOOTSTRAP=1
fi
# The core has no unsafe code, so AddressSanitizer would only slow the search down; debug
# assertions and overflow checks stay on (cargo fuzz's default without --release).
FUZZ=(cargo "${TOOLCHAIN[@]}" fuzz run --sanitizer none "$TARGET")
mkdir -p "corpus/$TARGET" "artifacts/$TARGET"
before=$(find "artifacts/$TARGET" -type f | wc -l)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
"${FUZZ[@]}" "corpus/$TARGET" seeds -- \
    -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -len_control=20 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1
status=$?
set -e
grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
after=$(find "artifacts/$TARGET" -type f | wc -l)
if [ "$status" -ne 0 ] || [ "$after" -gt "$before" ]; then
    echo "==== fuzz.sh: FAILURE (exit $status) — the fuzzer found a crash ====" >&2
    grep -E "panicked at|assertion|Test unit written|SUMMARY" "$log" >&2 || tail -n 40 "$log" >&2
    newest=$(ls -t "artifacts/$TARGET" 2>/dev/null | head -n 1)
    if [ -n "$newest" ]; then
        echo "reproduce: (cd fuzz && cargo ${TOOLCHAIN[*]} fuzz run --sanitizer none $TARGET artifacts/$TARGET/$newest)" >&2
        echo "minimize:  (cd fuzz && cargo ${TOOLCHAIN[*]} fuzz tmin --sanitizer none $TARGET artifacts/$TARGET/$newest)" >&2
    fi
    exit 1
fi
echo "fuzz.sh: no crash in ${SECONDS_TO_RUN}s"

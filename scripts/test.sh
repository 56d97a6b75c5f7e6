#!/usr/bin/env bash
# The project's whole check: formatting, lints, Rust tests (std and loom), the extension, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate

echo "== cargo fmt";    cargo fmt --all -- --check
echo "== cargo clippy"; cargo clippy --workspace --all-targets -q -- -D warnings
echo "== cargo test";   cargo nextest run --workspace --release --no-fail-fast 2>&1 | tail -n 25
echo "== loom";         RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2} \
                          cargo test -q --release -p hybrid-cache-core --target-dir target/loom --test loom && \
                        RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2} \
                          cargo test -q --release -p hybrid-cache-core --target-dir target/loom --lib loom_tests
echo "== fuzz";         command -v cargo-fuzz >/dev/null || cargo install -q --locked cargo-fuzz
                        cargo fmt --manifest-path fuzz/Cargo.toml -- --check
                        (cd fuzz && cargo clippy -q --all-targets -- -D warnings && cargo test -q --release --lib)
                        bash scripts/fuzz.sh "${FUZZ_SECONDS:-30}"
echo "== ruff";         ruff check python tests kernels scripts && ruff format --check python tests kernels scripts
echo "== pytest";       python -m pytest -q "$@"

#!/usr/bin/env bash
# Sets up (idempotently) and runs every test: lints, the core natively and inside a wasm
# runtime, the release .wasm build, and the wasm-tests crate (test host and end-to-end tests
# through a real Envoy in front of the simulated fleet).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
eval "$(scripts/setup.sh --env)"
export TOKENAWARE_REQUIRE_ENVOY=1

step() { echo; echo "=== $* ==="; }

step "the core has no proxy-wasm import"
if grep -rln "proxy_wasm" src --include='*.rs' | grep -v '^src/wasm/'; then
  echo "proxy_wasm used outside src/wasm/"; exit 1
fi

step "fmt"
cargo fmt --all -- --check

step "clippy (native, all targets)"
cargo clippy --workspace --all-targets -- -D warnings

step "clippy (wasm32-wasip1 filter)"
cargo clippy -p tokenaware --lib --target wasm32-wasip1 -- -D warnings

step "rustdoc (no broken intra-doc links)"
RUSTDOCFLAGS="-D warnings" cargo doc -p tokenaware --no-deps

step "release .wasm"
cargo build -p tokenaware --release --target wasm32-wasip1
ls -l target/wasm32-wasip1/release/tokenaware.wasm

step "core tests inside a wasm runtime (node:wasi)"
cargo test -p tokenaware --lib --target wasm32-wasip1

step "native tests (core, examples, test host, end to end)"
cargo test --workspace --all-targets

step "fuzz smoke (cargo fuzz, nightly: every target for a few seconds from fuzz/corpus)"
fuzz/smoke.sh

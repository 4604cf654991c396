#!/usr/bin/env bash
# Short fuzz run of every target from the committed corpus (about 8 s each, plus the build),
# for scripts/test.sh. fuzz/seeds/ holds the hand-written valid inputs; fuzz/corpus/ is the
# minimized corpus of the long runs (`cargo fuzz cmin`). New inputs go to a temporary
# directory, so both stay as committed. Needs a nightly toolchain (libFuzzer's sanitizer flags) and cargo-fuzz, which
# scripts/setup.sh installs under .tools/. Long runs, by hand:
#   PATH=$PWD/.tools/bin:$PATH nice -n 19 cargo +nightly fuzz run request -- \
#     -max_total_time=600 -dict=fuzz/request.dict
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-8}"
export PATH="$ROOT/.tools/bin:$PATH"
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz smoke SKIPPED: no nightly toolchain (cargo +nightly) on this machine"; exit 0
fi
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: run scripts/setup.sh"; exit 1; }
cargo +nightly fuzz build
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for t in request prefix prometheus peers; do
  dict=()
  [[ -f "fuzz/$t.dict" ]] && dict=("-dict=fuzz/$t.dict")
  mkdir -p "$tmp/$t"
  cargo +nightly fuzz run "$t" "$tmp/$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$SECS" "${dict[@]}" 2>"$tmp/$t.log" || { tail -40 "$tmp/$t.log"; exit 1; }
  grep -E '^Done' "$tmp/$t.log" | sed "s/^/$t: /"
done

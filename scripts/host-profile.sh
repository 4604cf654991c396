#!/usr/bin/env bash
# The filter's own compiled code by part: `hostprofile` (the `overhead` request, over and over,
# in the test host, compiled by Cranelift) under `perf record`, its samples in the filter's
# functions named through wasmtime's perf map and summed by part (parse, hash, allocation,
# tables, decision, response, SDK glue), as µs a request and as shares of the filter's code.
#
#   scripts/host-profile.sh [--requests N] [--features overhead-baseline] [--out-dir DIR]
#
# `--features overhead-baseline` profiles the bare yardstick (buffer, parse, hash, set the
# header) instead of the filter.
#
# Needs `perf` (Debian `linux-perf`). Builds the filter with its name section into
# target/hostprofile (the shipped build is stripped) and the tool. A measurement, not a test:
# the code runs warm here, so its µs are fewer than inside Envoy; the shares are the point.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REQUESTS=60000 OUT="target/host-profile" FEATURES=""
while (($#)); do
  case "$1" in
    --requests) REQUESTS="$2"; shift 2 ;;
    --features) FEATURES="$2"; shift 2 ;;
    --out-dir) OUT="$2"; shift 2 ;;
    *) echo "host-profile.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v perf >/dev/null || { echo "perf not found (apt-get install linux-perf)" >&2; exit 1; }
mkdir -p "$OUT"
BUILD="target/hostprofile${FEATURES:+-$FEATURES}"
CARGO_PROFILE_RELEASE_STRIP=false cargo build -q --release --target wasm32-wasip1 -p tokenaware \
  ${FEATURES:+--features "$FEATURES"} --target-dir "$BUILD"
cargo build -q --release -p wasm-tests --bin hostprofile
HZ=4999
perf record -q -F "$HZ" -o "$OUT/perf.data" -- target/release/hostprofile --requests "$REQUESTS" \
  --wasm "$BUILD/wasm32-wasip1/release/tokenaware.wasm" |
  tee "$OUT/hostprofile.log"
perf report -i "$OUT/perf.data" -n --no-children --sort dso,sym --stdio -g none 2>/dev/null \
  >"$OUT/report.txt"
python3 - "$OUT/report.txt" "$HZ" "$REQUESTS" <<'PY'
import re, sys
report, hz, requests = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
# Mangled-name pieces, first match wins.
PARTS = [
    ("parse (serde_json, request, UTF-8)", ["serde_json", "serde_core", "10tokenaware7request", "tokenaware..request",
                                            "from_utf8", "lossy"]),
    ("hash (xxhash, blocks)", ["xxhash_rust", "__multi3", "10tokenaware6prefix"]),
    ("memory (allocate, free, copy, compare)", ["dlmalloc", "dlfree", "malloc", "free", "realloc", "dispose_chunk",
                                                "rust_alloc", "rust_dealloc", "rdl_", "no_alloc_shim", "raw_vec",
                                                "drop_in_place", "drop_slow", "memcpy", "memmove", "memset",
                                                "memcmp", "memory_copy", "memory_fill"]),
    ("tables (store, index, ledger)", ["10tokenaware5store", "tokenaware..store", "10tokenaware5index",
                                       "10tokenaware6ledger", "2vm2Vm5table", "shared_prefixes", "10tokenaware5peers"]),
    ("decision (router, policy, endpoints)", ["10tokenaware6router", "10tokenaware6policy", "tokenaware..policy",
                                              "10tokenaware9endpoints"]),
    ("response (usage, served-by)", ["6filter5usage", "check_served_by"]),
    ("SDK and glue (proxy_wasm, callbacks, stats)", ["proxy_wasm", "trampoline", "proxy_on_", "10tokenaware4wasm",
                                                     "tokenaware..wasm", "6filter4http", "6filter5stats"]),
]
sums = {name: 0 for name, _ in PARTS}
sums["other"] = 0
total = jit = 0
top = []
for line in open(report, errors="replace"):
    m = re.match(r"\s*([\d.]+)%\s+(\d+)\s+(.*?)\s+\[[.k]\]\s+(.*)", line)
    if not m:
        continue
    n, dso, sym = int(m.group(2)), m.group(3), m.group(4)
    total += n
    if "JIT" not in dso and "perf-" not in dso:
        continue
    jit += n
    top.append((n, sym))
    for name, keys in PARTS:
        if any(k in sym for k in keys):
            sums[name] += n
            break
    else:
        sums["other"] += n
us = lambda n: n / hz / requests * 1e6
print(f"\n{requests} requests, {total} samples at {hz:g} Hz, {jit} in the filter's code ({us(jit):.2f} µs a request)")
print("| part of the filter's code | µs a request | share |")
print("|---|---:|---:|")
for name, n in sorted(sums.items(), key=lambda kv: -kv[1]):
    print(f"| {name} | {us(n):.2f} | {100 * n / max(jit, 1):.0f} % |")
print("\nlargest functions (share of the filter's code):")
for n, sym in sorted(top, reverse=True)[:12]:
    print(f"  {100 * n / max(jit, 1):5.1f} %  {sym[:110]}")
PY

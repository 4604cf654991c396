#!/usr/bin/env bash
# Where each Envoy's CPU goes per request, plain and with the filter: one `overhead` round
# with `perf record` (call graphs by DWARF) on both Envoys, then per request:
#   - by DSO: Envoy's own code, the filter's compiled code (V8's JIT), the kernel, libc;
#   - inside hostcalls: samples in Envoy's code with the filter's code among their callers
#     (Envoy serving a call the filter made), apart from Envoy's other work.
#
#   scripts/overhead-profile.sh [--wasm PATH] [--secs N] [--out-dir DIR]
#
# Needs `perf` (Debian `linux-perf`) and `target/release/overhead`
# (`cargo build -p wasm-tests --release --bin overhead`). A measurement, not a test: the
# figures move with the machine's state like every overhead figure (docs/benchmarks.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS=12 WASM="" OUT="target/overhead-profile"
while (($#)); do
  case "$1" in
    --wasm) WASM="$2"; shift 2 ;;
    --secs) SECS="$2"; shift 2 ;;
    --out-dir) OUT="$2"; shift 2 ;;
    *) echo "overhead-profile.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v perf >/dev/null || { echo "perf not found (apt-get install linux-perf)" >&2; exit 1; }
[[ -x target/release/overhead ]] || { echo "build target/release/overhead first" >&2; exit 1; }
mkdir -p "$OUT"
args=(--secs "$SECS" --rounds 1 --sizes 4096 --pairs 20 --out-dir "$OUT")
[[ -n "$WASM" ]] && args+=(--wasm "$WASM")
target/release/overhead "${args[@]}" >"$OUT/overhead.log" 2>&1 &
harness=$!
pids=""
for _ in $(seq 1 100); do
  pids="$(grep -o 'plain pid [0-9]* / filter pid [0-9]*' "$OUT/overhead.log" || true)"
  [[ -n "$pids" ]] && break
  sleep 0.1
done
[[ -n "$pids" ]] || { cat "$OUT/overhead.log" >&2; exit 1; }
plain="$(awk '{print $3}' <<<"$pids")" filter="$(awk '{print $7}' <<<"$pids")"
# Each recording ends when its Envoy exits, at the end of the harness.
perf record -q -F 499 --call-graph dwarf,16384 -o "$OUT/plain.data" -p "$plain" >/dev/null 2>&1 &
perf record -q -F 499 --call-graph dwarf,16384 -o "$OUT/filter.data" -p "$filter" >/dev/null 2>&1 &
wait "$harness"
wait
grep -E '^\| 4096 B' "$OUT/overhead.log"
# The summary row: rps plain and rps filter are columns 2 and 3 (min / median / max).
read -r rps_plain rps_filter < <(grep -E '^\| 4096 B' "$OUT/overhead.log" |
  awk -F'|' '{split($3,a," / "); split($4,b," / "); print a[2], b[2]}')
for who in plain filter; do
  perf script -i "$OUT/$who.data" -F ip,dso >"$OUT/$who.stacks" 2>/dev/null
done
python3 - "$OUT" "$SECS" "$rps_plain" "$rps_filter" <<'EOF'
import collections, sys
out, secs, rps = sys.argv[1], float(sys.argv[2]), {"plain": float(sys.argv[3]), "filter": float(sys.argv[4])}
HZ = 499.0

def kind(dso):
    if "perf-" in dso or "JIT" in dso:
        return "filter code (JIT)"
    if "kernel" in dso:
        return "kernel"
    if "envoy" in dso:
        return "envoy"
    return dso.strip("()").rsplit("/", 1)[-1] or "other"

def stacks(path):
    cur = []
    for line in open(path, errors="replace"):
        line = line.strip()
        if not line:
            if cur:
                yield cur
            cur = []
            continue
        parts = line.split(None, 1)
        cur.append(kind(parts[1] if len(parts) > 1 else ""))
    if cur:
        yield cur

print(f"\nµs of CPU per request ({secs:g} s at the median requests/s; {HZ:g} Hz samples)")
rows = {}
for who in ("plain", "filter"):
    per = 1e6 / HZ / (rps[who] * secs)
    c = collections.Counter()
    for s in stacks(f"{out}/{who}.stacks"):
        leaf = s[0]
        if leaf != "filter code (JIT)" and "filter code (JIT)" in s[1:]:
            c[f"{leaf}, in a hostcall"] += 1
        else:
            c[leaf] += 1
    rows[who] = {k: v * per for k, v in c.items()}
keys = sorted(set(rows["plain"]) | set(rows["filter"]), key=lambda k: -rows["filter"].get(k, 0))
print(f"| {'where':32} | plain | filter | added |")
print("|---|---:|---:|---:|")
for k in keys:
    p, f = rows["plain"].get(k, 0.0), rows["filter"].get(k, 0.0)
    if max(p, f) >= 0.5:
        print(f"| {k:32} | {p:5.1f} | {f:6.1f} | {f - p:+5.1f} |")
tp, tf = sum(rows["plain"].values()), sum(rows["filter"].values())
print(f"| {'total':32} | {tp:5.1f} | {tf:6.1f} | {tf - tp:+5.1f} |")
EOF

#!/usr/bin/env bash
# The tokenaware demo: a simulated vLLM fleet on 127.0.0.1:8001.. and Envoy with the filter
# on 127.0.0.1:10000 (admin 127.0.0.1:9901). Runs until Ctrl-C or SIGTERM, then stops
# everything it started. Safe to run again (setup and builds are incremental).
#
#   envoy/demo.sh [--endpoints N] [--time-factor F]
#
# Logs and the rendered config go to ${TMPDIR:-/tmp}/tokenaware-demo/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
N=3 TIME_FACTOR=1.0 BASE_PORT=8001 LISTEN=10000 ADMIN=9901
while (($#)); do
  case "$1" in
    --endpoints) N="$2"; shift 2 ;;
    --time-factor) TIME_FACTOR="$2"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "demo.sh: --endpoints must be a positive number" >&2; exit 2; }

say() { echo "demo: $*" >&2; }
port_busy() { (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

for p in "$LISTEN" "$ADMIN" $(seq "$BASE_PORT" $((BASE_PORT + N - 1))); do
  if port_busy "$p"; then
    say "port $p is in use (another demo still running?); stop it first"; exit 1
  fi
done

eval "$(scripts/setup.sh --env)"
say "building the filter (release .wasm) and the fleet"
cargo build -q -p tokenaware --release --target wasm32-wasip1
cargo build -q -p wasm-tests --release --bin fleet
WASM="$ROOT/target/wasm32-wasip1/release/tokenaware.wasm"
say "tokenaware.wasm: $(stat -c %s "$WASM") bytes"

DIR="${TMPDIR:-/tmp}/tokenaware-demo"
mkdir -p "$DIR"
EPS=() LIST=()
for i in $(seq 0 $((N - 1))); do
  EPS+=("127.0.0.1:$((BASE_PORT + i))")
  LIST+=("{\"address\":\"127.0.0.1:$((BASE_PORT + i))\"}")
done
CONFIG="{\"endpoints\":[$(IFS=,; echo "${LIST[*]}")],\"metrics\":{\"cluster\":\"models\",\"intervalMs\":500},\"decisionHeader\":true,\"debugPath\":\"/debug/tokenaware\"}"
envoy/render.sh --endpoints "$(IFS=,; echo "${EPS[*]}")" --listen "$LISTEN" --admin "$ADMIN" \
  --wasm "$WASM" --config "$CONFIG" >"$DIR/gateway.yaml"

PIDS=()
cleanup() {
  trap - EXIT INT TERM
  say "stopping"
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

target/release/fleet --endpoints "$N" --base-port "$BASE_PORT" --time-factor "$TIME_FACTOR" \
  >"$DIR/fleet.log" 2>&1 &
PIDS+=($!)
"$ENVOY_BIN" -c "$DIR/gateway.yaml" --concurrency 2 --disable-hot-restart \
  >"$DIR/access.log" 2>"$DIR/envoy.log" &
PIDS+=($!)

for _ in $(seq 150); do
  if curl -fs "http://127.0.0.1:$ADMIN/ready" >/dev/null 2>&1 \
    && curl -fs "http://${EPS[0]}/health" >/dev/null 2>&1; then
    break
  fi
  for p in "${PIDS[@]}"; do
    kill -0 "$p" 2>/dev/null || { say "a process exited; see $DIR/envoy.log and $DIR/fleet.log"; tail -5 "$DIR/envoy.log" >&2; exit 1; }
  done
  sleep 0.2
done
curl -fs "http://127.0.0.1:$ADMIN/ready" >/dev/null || { say "Envoy not ready; see $DIR/envoy.log"; exit 1; }

# A system prompt of ~1,700 bytes (~430 tokens, several 64-token blocks) shared by both
# requests; only the question differs.
PROMPT='P=$(printf "You are a careful assistant. %.0s" {1..60})'
curl_for() {
  echo "curl -s -D - -o /dev/null http://127.0.0.1:$LISTEN/v1/chat/completions -H 'content-type: application/json' -d '{\"model\":\"sim-model\",\"max_tokens\":8,\"messages\":[{\"role\":\"system\",\"content\":\"'\"\$P\"'\"},{\"role\":\"user\",\"content\":\"$1\"}]}' | grep -iE '^(HTTP|x-fleet-endpoint|x-tokenaware-decision)'"
}
cat <<MSG

tokenaware demo is up: fleet ${EPS[0]}..${EPS[$((N - 1))]}, Envoy 127.0.0.1:$LISTEN (admin 127.0.0.1:$ADMIN).

Two routed requests sharing a long system prompt (the second sticks to the first's endpoint):

  $PROMPT
  $(curl_for "Hello!")
  $(curl_for "And again?")

MSG
eval "$PROMPT"
for q in "Hello!" "And again?"; do
  eval "$(curl_for "$q")" | sed 's/^/  > /'
done
cat <<MSG

Stats:   curl -s 'http://127.0.0.1:$ADMIN/stats?filter=tokenaware'
Tables:  curl -s http://127.0.0.1:$LISTEN/debug/tokenaware
Logs:    $DIR/{envoy.log,access.log,fleet.log}

Ctrl-C stops the demo.
MSG
wait -n "${PIDS[@]}" || true
say "a process exited; see $DIR/envoy.log and $DIR/fleet.log"

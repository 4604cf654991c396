#!/usr/bin/env bash
# Renders envoy/gateway.yaml.tmpl to stdout.
#
#   envoy/render.sh --endpoints 127.0.0.1:8000,127.0.0.1:8001 [--listen 10000] [--admin 9901] \
#       [--wasm PATH --config JSON | --config-file FILE]     # omit --wasm: plain Envoy (no filter)
#
# The plugin config is put in a single-quoted YAML string (single quotes are doubled).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LISTEN_PORT=10000 ADMIN_PORT=9901 ENDPOINTS_CSV="" WASM_FILE="" PLUGIN_CONFIG="{}"
while (($#)); do
  case "$1" in
    --listen) LISTEN_PORT="$2"; shift 2 ;;
    --admin) ADMIN_PORT="$2"; shift 2 ;;
    --endpoints) ENDPOINTS_CSV="$2"; shift 2 ;;
    --wasm) WASM_FILE="$(realpath "$2")"; shift 2 ;;
    --config) PLUGIN_CONFIG="$2"; shift 2 ;;
    --config-file) PLUGIN_CONFIG="$(cat "$2")"; shift 2 ;;
    *) echo "render.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n "$ENDPOINTS_CSV" ]] || { echo "render.sh: --endpoints required" >&2; exit 2; }

ENDPOINTS=""
IFS=',' read -ra eps <<<"$ENDPOINTS_CSV"
for ep in "${eps[@]}"; do
  ENDPOINTS+="        - endpoint: { address: { socket_address: { address: ${ep%:*}, port_value: ${ep##*:} } } }"$'\n'
done
ENDPOINTS="${ENDPOINTS%$'\n'}"

tmpl="$(cat "$HERE/gateway.yaml.tmpl")"
if [[ -z "$WASM_FILE" ]]; then
  tmpl="$(sed '/#@wasm-begin/,/#@wasm-end/d' <<<"$tmpl")"
fi
q="'"
PLUGIN_CONFIG="${PLUGIN_CONFIG//$q/$q$q}"
tmpl="${tmpl//'${LISTEN_PORT}'/$LISTEN_PORT}"
tmpl="${tmpl//'${ADMIN_PORT}'/$ADMIN_PORT}"
tmpl="${tmpl//'${ENDPOINTS}'/$ENDPOINTS}"
tmpl="${tmpl//'${WASM_FILE}'/$WASM_FILE}"
tmpl="${tmpl//'${PLUGIN_CONFIG}'/$PLUGIN_CONFIG}"
printf '%s\n' "$tmpl"

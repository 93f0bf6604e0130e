#!/usr/bin/env bash
# The image's binary built with profile-guided optimisation (PGO): the `dist` build
# (fat LTO, one codegen unit) laid out by what the request path really runs.
#
#   scripts/pgo-build.sh          -> target/pgo/dist/portico   (about 15 minutes on 2 cores)
#   PGO_PROFILE=NAME scripts/pgo-build.sh   (another Cargo profile, the same way: target/pgo/NAME)
#
# 1. An instrumented build (`-Cprofile-generate`) into target/pgo/gen.
# 2. Training: that binary serves load on the rig of `scripts/rig.sh` (an nginx backend),
#    each of the paths the image is benchmarked on, for some seconds each: HTTP/1.1 keep-alive
#    (h2load --h1) and h2c through the router alone; HTTP/1.1 through istiod's gateway chain
#    (access log, tracing, Istio's filters); TLS 1.3 downstream (h2 and HTTP/1.1 by ALPN, new
#    connections too); TLS to the upstream. Each run ends with SIGTERM, when the binary
#    writes its counts.
# 3. `llvm-profdata merge` (rustup's llvm-tools, the same LLVM as rustc), then the optimised
#    build (`-Cprofile-use`) into target/pgo; target/pgo/dist/portico.source names the
#    source it was built from (`cargo bench --bench vs-envoy` measures this binary when that
#    is the current commit's).
#
# Functions the training never runs are laid out as cold, not left out: every path still
# works, the untrained ones are not made faster.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/pgo
profile=${PGO_PROFILE:-dist}
port=${PORT:-19580}

missing=()
for tool in nginx h2load openssl curl; do
  if ! command -v "$tool" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$tool" ]; then
    pkg=$tool
    [ "$tool" = h2load ] && pkg=nghttp2-client
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "pgo-build: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
host=$(rustc -vV | awk '/^host:/ {print $2}')
profdata="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
if [ ! -x "$profdata" ]; then
  rustup component add llvm-tools >/dev/null
fi
if [ ! -x "$profdata" ]; then
  echo "pgo-build: no llvm-profdata at $profdata (rustup component add llvm-tools)" >&2
  exit 1
fi

raw="$PWD/$out/raw"
rm -rf "$raw"
mkdir -p "$raw"
echo "pgo-build: instrumented build" >&2
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$raw" \
  cargo build --profile "$profile" --locked --bin portico --target-dir "$out/gen"
gen="$out/gen/$profile/portico"

# shellcheck source=scripts/rig.sh
. scripts/rig.sh
work=$(mktemp -d)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  rig_stop_backend "$work"
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
rig_cert "$work"
rig_backend "$work" $((port + 1)) $((port + 3)) "$work/cert.pem" "$work/key.pem"

# load URL ARGS...: h2load's run, which must have succeeded whole.
load() {
  local url=$1
  shift
  local got
  got=$(h2load "$@" "$url" 2>&1)
  if ! grep -q "^requests: .* 0 failed" <<<"$got"; then
    echo "pgo-build: training load failed: h2load $* $url" >&2
    grep -E "^requests:|status codes:" <<<"$got" >&2
    exit 1
  fi
}

for chain in router istio tls upstream-tls; do
  backend=$((port + 1))
  [ "$chain" = upstream-tls ] && backend=$((port + 3))
  rig_bootstrap "$chain" "$work/bootstrap.yaml" "$port" "$backend" $((port + 2)) "$work" \
    "$work/cert.pem" "$work/key.pem"
  "$gen" -c "$work/bootstrap.yaml" >"$work/portico.log" 2>&1 &
  pid=$!
  scheme=http
  [ "$chain" = tls ] && scheme=https
  url="$scheme://127.0.0.1:$port/"
  for _ in $(seq 1 100); do
    curl -sk -o /dev/null "$url" && break
    sleep 0.2
  done
  echo "pgo-build: training on the $chain chain" >&2
  case "$chain" in
    router)
      load "$url" -n 200000 -c 50 --h1
      load "$url" -n 100000 -c 50 -m 10
      ;;
    istio | upstream-tls)
      load "$url" -n 100000 -c 50 --h1
      ;;
    tls)
      load "$url" -n 100000 -c 50 --h1
      load "$url" -n 50000 -c 50 -m 10
      # New connections: a handshake each.
      for _ in $(seq 1 300); do
        curl -sk -o /dev/null "$url"
      done
      ;;
  esac
  kill -TERM "$pid"
  if ! wait "$pid"; then
    echo "pgo-build: the instrumented binary did not exit cleanly on the $chain chain:" >&2
    tail -5 "$work/portico.log" >&2
    exit 1
  fi
  pid=""
done

"$profdata" merge -o "$out/portico.profdata" "$raw"/*.profraw
echo "pgo-build: optimised build" >&2
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$PWD/$out/portico.profdata" \
  cargo build --profile "$profile" --locked --bin portico --target-dir "$out"
# What it was built from: the committed objects of what the binary is built of (`git ls-tree`,
# which `vs-envoy` compares with the current commit's), if the tree held no change to them.
source=unknown
if git rev-parse HEAD >/dev/null 2>&1; then
  if [ -z "$(git status --porcelain -- src build.rs Cargo.toml Cargo.lock)" ]; then
    source=$(git ls-tree HEAD src build.rs Cargo.toml Cargo.lock)
  else
    source="uncommitted changes"
  fi
fi
echo "$source" >"$out/$profile/portico.source"
echo "pgo-build: $out/$profile/portico" >&2

#!/usr/bin/env bash
# The test command from README.md (and what CI runs): set-up, lint, the test build, every
# example validated by Portico and by Envoy, unit and integration tests against Portico, then
# the same integration tests against the real Envoy to prove they describe Envoy's behaviour.
# No release build: the tests run the test profile's binary, and a release build only to
# validate the examples cost a fresh clone's run 8.5 of its 29 minutes on 2 cores (README,
# Quick start; the release binary validates as the test build's does: one source, one
# validator).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-envoy
envoy_bin=$(scripts/envoy-path.sh)
# A one-shot build gains nothing from incremental state, which would only take disk space.
export CARGO_INCREMENTAL=0

step() { printf '\n==> %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
step "test build (unit and integration tests, benches as tests, the portico binary)"
cargo test --all-targets --no-run --quiet
step "validate gateway-examples with Portico and Envoy"
portico_bin="${CARGO_TARGET_DIR:-target}/debug/portico"
for f in gateway-examples/bootstraps/*.yaml; do
  "$portico_bin" --mode validate -c "$f" --log-level error
  "$envoy_bin" --mode validate -c "$f" --log-level error >/dev/null
done
step "validate the load rig's bootstraps (scripts/rig.sh) with Portico and Envoy"
rig=$(mktemp -d)
(
  . scripts/rig.sh
  rig_cert "$rig"
  for chain in router istio tls upstream-tls; do
    rig_bootstrap "$chain" "$rig/$chain.yaml" 19580 19581 19582 "$rig" "$rig/cert.pem" "$rig/key.pem"
  done
)
for chain in router istio tls upstream-tls; do
  "$portico_bin" --mode validate -c "$rig/$chain.yaml" --log-level error
  # The istio chain holds istio-proxy's own filters, which stock Envoy does not build.
  if [ "$chain" != istio ]; then
    "$envoy_bin" --mode validate -c "$rig/$chain.yaml" --log-level error >/dev/null
  fi
done
rm -rf "$rig"
step "validate gateway-examples/kubernetes against Kubernetes' schemas"
scripts/validate-k8s.sh
step "tests against Portico"
cargo test --all-targets
step "integration tests against Envoy ($envoy_bin)"
PORTICO_GATEWAY_BIN="$envoy_bin" cargo test --test '*'

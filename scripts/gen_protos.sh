#!/usr/bin/env bash
# Regenerates the committed Python stubs (messages, gRPC stubs, .pyi) from proto/hetfed/v1/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-proto}
python -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/hetfed/v1/*.proto

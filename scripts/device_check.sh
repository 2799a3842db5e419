#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent CUDA machine (docs/benchmarks.md#round-overhead-on-a-gpu).
#
# The machine's image has CUDA torch, pytest and xdist but not all of hetfed's packages. Carry them as wheels
# for its Python (3.12, x86-64), downloaded here into .whl/ (ignored by git):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_34_x86_64 -d .whl grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#     grpcio-status==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0 cryptography==50.0.2 cffi==2.1.1 \
#     pycparser==3.12 mlxtend==0.25.0 opacus==1.6.0 dp-accounting==0.6.0 dm-tree==0.1.10 attrs==23.2.0 blake3==1.0.11
# then run this script there with .whl carried. Results land in $OUT (or /tmp/device-check):
#   1. workload B against a plain PyTorch loop on the GPU (round_overhead.py --device cuda --plain);
#   2. DP-SGD's cost per epoch on the GPU against the plain loop (dp_step_cost.py --device cuda);
#   3. the client, end-to-end and privacy tests with every client on CUDA (device = "auto" picks it).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device-check}
mkdir -p "$out"
# shellcheck source=scripts/device_env.sh
. scripts/device_env.sh
nvidia-smi -L
python3 -c 'import torch, grpc, google.protobuf as pb
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "grpc", grpc.__version__, "protobuf", pb.__version__)'
git log -1 --format='commit %h %s' 2>/dev/null || true

timeout 180 python3 benchmarks/round_overhead.py --workload B --clients 1,4 --rounds 12 --device cuda --plain \
  --json "$out/b_cuda.json" 2>&1 | tee "$out/round_overhead.log"
timeout 90 python3 benchmarks/dp_step_cost.py --device cuda --repeats 3 2>&1 | tee "$out/dp_step_cost.log"
timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/client tests/e2e/test_local_run.py \
  tests/e2e/test_simfed.py tests/e2e/test_ditto.py tests/e2e/test_fedcma.py tests/e2e/test_fedh2l.py \
  tests/e2e/test_fedsr.py tests/e2e/test_privacy_e2e.py tests/e2e/test_own_code.py 2>&1 | tee "$out/tests.log"

# Sourced by scripts/device_check.sh and scripts/device_repro.sh from the repository root: hetfed's packages on
# the lent machine's Python. Wheels carried in .whl/ (device_check.sh's header names them) go to /tmp/site first.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD/proto:$PWD/services:$PWD/clients
else
  export PYTHONPATH=$PWD/proto:$PWD/services:$PWD/clients
fi
export PYTHONUNBUFFERED=1
# Fashion-MNIST's idx files, carried in .fmnist/ (the machine has no dataset-fashion-mnist package).
if [ -d .fmnist ]; then
  export HETFED_FASHION_MNIST_DIR=$PWD/.fmnist
fi

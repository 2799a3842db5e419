#!/usr/bin/env bash
# The long reproductions on a lent machine, clients on CUDA, as one command (docs/benchmarks.md#paper-reproductions-hetfed-bench-name).
#
# Carry the wheels as for scripts/device_check.sh (.whl/, its header says which). Then, on the machine:
#   scripts/device_repro.sh GRID [hetfed bench options...]
# for example
#   scripts/device_repro.sh fedsr_long --seeds 0,1,2 --methods fedavg,fedsr_paper --jobs 6
# Every federation is the usual aggregator and client processes over loopback; the clients pick CUDA where it is
# (device = "auto"). Carry a previous run's rows back as $RESUME_ROWS (a rows.json) to skip the federations it
# measured. What comes back in $OUT (or /tmp/device-repro): rows.json (every federation measured so far, for
# --resume here), GRID.json and GRID.md (the measurements and the page, as `hetfed bench` writes them), bench.log.
# Merge here with: cp OUT/rows.json WORKDIR/rows.json && hetfed bench GRID --resume --workdir WORKDIR [same options].
# ROUNDS=N runs every federation for N rounds instead of the grid's (a check that the command works, not a result).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: scripts/device_repro.sh GRID [hetfed bench options...]" >&2
  exit 2
fi
grid=$1
shift
out=${OUT:-/tmp/device-repro}
work=${WORKDIR:-/tmp/device-repro-work}
mkdir -p "$out" "$work"
# shellcheck source=scripts/device_env.sh
. scripts/device_env.sh
command -v nvidia-smi >/dev/null && nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
git log -1 --format='commit %h %s' 2>/dev/null || true
if [ -n "${RESUME_ROWS:-}" ]; then
  cp "$RESUME_ROWS" "$work/rows.json"
fi
rounds=()
if [ -n "${ROUNDS:-}" ]; then
  rounds=(--rounds "$ROUNDS")
fi
python3 -m hetfed.cli bench "$grid" "$@" "${rounds[@]}" --resume --no-bytes --workdir "$work" \
  --json "$out/$grid.json" --page "$out/$grid.md" 2>&1 | tee "$out/bench.log"
status=${PIPESTATUS[0]}
cp "$work/rows.json" "$out/rows.json" 2>/dev/null || true
exit "$status"

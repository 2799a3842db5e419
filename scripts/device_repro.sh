#!/usr/bin/env bash
# The long reproductions on a lent machine, clients on CUDA, as one command (docs/benchmarks.md#paper-reproductions-hetfed-bench-name).
#
# Carry the wheels as for scripts/device_check.sh (.whl/, its header says which). Then, on the machine:
#   scripts/device_repro.sh GRID [hetfed bench options...]
# for example
#   scripts/device_repro.sh fedsr_long --seeds 0,1,2 --methods fedavg,fedsr_paper --jobs 6
# Every federation is the usual aggregator and client processes over loopback; the clients pick CUDA where it is
# (device = "auto"); a federation that fails does not stop the others (--keep-going). Carry a previous run's
# rows back as $RESUME_ROWS (a rows.json) to skip the federations it measured. What comes back in $OUT (or
# /tmp/device-repro): rows.json (every federation measured so far, for --resume here), GRID.json and GRID.md (the
# measurements and the page, as `hetfed bench` writes them), bench.log.
# Merge here with: cp OUT/rows.json WORKDIR/rows.json && hetfed bench GRID --resume --workdir WORKDIR [same options].
# ROUNDS=N runs every federation for N rounds instead of the grid's (a check that the command works, not a result).
# Fashion-MNIST grids: the machine has no dataset-fashion-mnist; copy its four files into .fmnist/ here (ignored by
# git: `echo /.fmnist/ >> .git/info/exclude; cp /usr/share/datasets/fashion-mnist/* .fmnist/`, 30 MB) and carry it.
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
# Each client process on CUDA holds 0.63-0.91 GiB of GPU memory, whatever its model's size (the CUDA context, the
# cuBLAS workspace and the allocator's cache: LeNet clients on an H100, torch 2.11). Five 20-client
# federations at once (100 processes) ran an 80 GB card out of memory and their clients failed; so --jobs is
# capped at what the card's free memory holds, counting GPU_GIB_PER_CLIENT (default 0.95) a client.
args=("$@")
if command -v nvidia-smi >/dev/null; then
  jobs=1
  for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
      --jobs) jobs=${args[i + 1]:-1} ;;
      --jobs=*) jobs=${args[i]#--jobs=} ;;
    esac
  done
  free_mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
  fit=$(python3 -c "from hetfed.cli.reproduce import load_grid
g = load_grid('$grid'); n = int(g.data.get('clients', 1))
print(max(1, int($free_mib / 1024 / (n * ${GPU_GIB_PER_CLIENT:-0.95}))))")
  if [ "$jobs" -gt "$fit" ]; then
    echo "device_repro: --jobs $jobs would not fit: ${free_mib} MiB free holds $fit federation(s) of this grid's" \
      "clients at ${GPU_GIB_PER_CLIENT:-0.95} GiB each; running with --jobs $fit" >&2
    for ((i = 0; i < ${#args[@]}; i++)); do
      case ${args[i]} in
        --jobs) args[i + 1]=$fit ;;
        --jobs=*) args[i]=--jobs=$fit ;;
      esac
    done
  fi
fi
rounds=()
if [ -n "${ROUNDS:-}" ]; then
  rounds=(--rounds "$ROUNDS")
fi
# BUDGET=S stops the grid after S seconds with SIGTERM, which `hetfed bench` answers by stopping its federations
# (those still running are lost; those finished are kept), so the rows come back from a call that would
# otherwise outlast the machine's per-call limit. (SIGINT would not do: a shell's background job ignores it.)
limit=()
if [ -n "${BUDGET:-}" ]; then
  limit=(timeout -k 30 "$BUDGET")
fi
"${limit[@]}" python3 -m hetfed.cli bench "$grid" "${args[@]}" "${rounds[@]}" --resume --keep-going --no-bytes \
  --workdir "$work" --json "$out/$grid.json" --page "$out/$grid.md" 2>&1 | tee -a "$out/bench.log"
status=${PIPESTATUS[0]}
cp "$work/rows.json" "$out/rows.json" 2>/dev/null || true
exit "$status"

#!/usr/bin/env bash
# Run fbt-train as NUM_PROCESSES cooperating processes on this machine (jax.distributed over
# localhost, fake CPU devices), the way a multi-host pod runs it. For tests, and for users
# without a cluster.
#
#   launch/local.sh [--dry-run] [--devices-per-process N] NUM_PROCESSES <fbt-train args...>
#   e.g. launch/local.sh 2 --config=configs/tiny.py --config.workdir=runs/local2
#
# Prints the command of every process first; --dry-run prints them and exits. If any process
# fails, the others are stopped (so a crash never leaves the rest waiting in a collective).
set -euo pipefail

dry_run=0
devices_per_process=2
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --devices-per-process) devices_per_process="$2"; shift 2 ;;
    *) break ;;
  esac
done
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: launch/local.sh [--dry-run] [--devices-per-process N] NUM_PROCESSES <fbt-train args...>" >&2
  exit 2
fi
num_processes="$1"; shift

python=${PYTHON:-python3}
port=${FBT_COORDINATOR_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
if command -v fbt-train >/dev/null 2>&1; then train=(fbt-train); else train=("$python" -m fbt_jax.train); fi

commands=()
for ((i = 0; i < num_processes; i++)); do
  commands+=("env JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=${devices_per_process} \
${train[*]} $(printf '%q ' "$@")--config.distributed.coordinator_address=127.0.0.1:${port} \
--config.distributed.num_processes=${num_processes} --config.distributed.process_id=${i}")
done
for ((i = 0; i < num_processes; i++)); do echo "[local.sh] process $i: ${commands[$i]}"; done
[[ $dry_run -eq 1 ]] && exit 0

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for ((i = 0; i < num_processes; i++)); do
  bash -c "${commands[$i]}" &
  pids+=($!)
done
status=0
# Wait for the processes one by one; the first failure stops the others and sets the exit code.
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  set +e; wait -n -p finished "${running[@]}"; rc=$?; set -e
  if [[ $rc -ne 0 ]]; then status=$rc; break; fi
  remaining=(); for pid in "${running[@]}"; do [[ "$pid" != "$finished" ]] && remaining+=("$pid"); done
  running=("${remaining[@]+"${remaining[@]}"}")
done
if [[ $status -ne 0 ]]; then
  echo "[local.sh] a process exited with status $status; stopping the others" >&2
  exit "$status"
fi
trap - EXIT

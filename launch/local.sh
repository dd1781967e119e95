#!/usr/bin/env bash
# Run fbt-train as NUM_PROCESSES cooperating processes on this machine (jax.distributed over
# localhost, fake CPU devices), the way a multi-host pod runs it. For tests, and for users
# without a cluster.
#
#   launch/local.sh [--dry-run] [--devices-per-process N] NUM_PROCESSES <fbt-train args...>
#   e.g. launch/local.sh 2 --config=configs/tiny.py --config.workdir=runs/local2
#
# Prints the command of every process first; --dry-run prints them and exits. If any process
# fails, the others are stopped (so a crash never leaves the rest waiting in a collective) and the
# launcher exits with its status, after one last line on stderr:
#   local.sh: process I exited with status S: <that process's own last line>; stopped the others
# Bad arguments to the launcher itself exit 2 with one line `local.sh: ...`.
set -euo pipefail

dry_run=0
devices_per_process=2
usage="usage: launch/local.sh [--dry-run] [--devices-per-process N] NUM_PROCESSES <fbt-train args...>"
fail() { echo "local.sh: $1; $usage" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --devices-per-process)
      [[ $# -ge 2 && "$2" =~ ^[0-9]+$ && "$2" -ge 1 ]] || fail "--devices-per-process needs a positive integer (got '${2-}')"
      devices_per_process="$2"; shift 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || fail "NUM_PROCESSES is missing"
[[ "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || fail "NUM_PROCESSES must be a positive integer (got '$1')"
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

# Each process's stderr passes through a relay that copies it to ours whole lines at a time (so
# the processes' lines do not interleave) and keeps its tail, so that a failure can be reported
# as one line: the failing process's own last line. The relay ignores SIGINT/SIGTERM and ends when
# its process's stderr closes.
relay='
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pending, tail = b"", b""
def emit(data):
    while data:
        try:
            data = data[os.write(2, data):]
        except OSError:
            return
while True:
    ready = select.select([0], [], [], 0.2 if pending else None)[0]
    chunk = os.read(0, 65536) if ready else b""
    if ready and not chunk:
        break
    pending += chunk
    cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1 if chunk else len(pending)
    emit(pending[:cut])
    tail, pending = (tail + pending[:cut])[-8192:], pending[cut:]
emit(pending)
try:
    with open(sys.argv[1], "wb") as f:
        f.write(tail + pending)
except OSError:
    pass
'
logdir=$(mktemp -d "${TMPDIR:-/tmp}/fbt-local.XXXXXX")
job_pids=()  # one subshell per process: the process piped into its relay
stop_processes() {  # a signal to every process still running (the relays end with them)
  local f
  for f in "$logdir"/*.pid; do
    if [[ -s "$f" ]]; then kill "-${1:-TERM}" "$(<"$f")" 2>/dev/null || true; fi
  done
}
interrupted=0
trap 'interrupted=1; stop_processes' INT TERM
trap 'stop_processes; rm -rf "$logdir"' EXIT
for ((i = 0; i < num_processes; i++)); do
  (bash -c "echo \$\$ > $(printf '%q' "$logdir/$i.pid"); exec ${commands[$i]}" 2>&1 1>&3 3>&- \
    | "$python" -c "$relay" "$logdir/$i.err") 3>&1 &
  job_pids+=($!)
done
status=0
failed=-1
# Wait for the processes one by one; the first failure stops the others and sets the exit code.
running=("${job_pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  set +e; wait -n -p finished "${running[@]}"; rc=$?; set -e
  if [[ $rc -ne 0 ]]; then
    status=$rc
    for ((i = 0; i < num_processes; i++)); do [[ "${job_pids[$i]}" == "${finished-}" ]] && failed=$i; done
    break
  fi
  remaining=(); for pid in "${running[@]}"; do [[ "$pid" != "$finished" ]] && remaining+=("$pid"); done
  running=("${remaining[@]+"${remaining[@]}"}")
done
if [[ $status -ne 0 ]]; then
  stop_processes
  # Let the others (and every relay) finish writing, so that the line below comes last; a process
  # that has not stopped 15 s after SIGTERM is killed.
  for ((t = 0; t < 200; t++)); do
    alive=0
    for pid in "${job_pids[@]}"; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done
    if [[ $alive -eq 0 ]]; then break; fi
    if [[ $t -eq 150 ]]; then stop_processes KILL; fi
    sleep 0.1
  done
  if [[ $interrupted -eq 1 ]]; then
    echo "local.sh: interrupted; stopped the processes (the same command resumes from the last checkpoint saved)" >&2
  elif [[ $failed -ge 0 ]]; then
    # The failing process's last non-empty line (after the last carriage return of a progress bar).
    message=$(tr '\r' '\n' 2>/dev/null < "$logdir/$failed.err" | grep -v '^[[:space:]]*$' | tail -n 1 || true)
    echo "local.sh: process $failed exited with status $status: ${message:-no message}; stopped the others" >&2
  else
    echo "local.sh: a process exited with status $status; stopped the others" >&2
  fi
  exit "$status"
fi
trap - EXIT INT TERM
rm -rf "$logdir"

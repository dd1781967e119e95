#!/usr/bin/env bash
# Run fbt-train as NUM_PROCESSES cooperating processes on this machine (jax.distributed over
# localhost, fake CPU devices), the way a multi-host pod runs it. For tests, and for users
# without a cluster.
#
#   launch/local.sh [--max-restarts=N] [--restart-delay=SECONDS] [--dry-run] [--devices-per-process N]
#                   NUM_PROCESSES <fbt-train args...>
#   e.g. launch/local.sh 2 --config=configs/tiny.py --config.workdir=runs/local2
#
# Prints the command of every process first; --dry-run prints them and exits. If any process
# fails, the others are stopped (so a crash never leaves the rest waiting in a collective) and the
# launcher exits with its status, after one last line on stderr:
#   local.sh: process I exited with status S: <that process's own last line>; stopped the others
# Bad arguments to the launcher itself exit 2 with one line `local.sh: ...`.
#
# Supervision: with --max-restarts=N (default 0: none) a run that ends with a status worth retrying
# is started again, the same command, so it resumes from its last checkpoint; at most N times,
# after --restart-delay seconds (default 5), doubled at every restart up to 300 s (or the delay
# given, if longer). Each restart is one line on stderr:
#   local.sh: attempt A/N+1 ended with status S (<why>); restarting in D s
# Retried: 75 (preempted: the run saved and stopped) and any other failure (a crash, a death by a
# signal such as an OOM kill). Not retried, the launcher exits with the status at once: the codes
# fbt-train uses for what a restart cannot fix (fbt_jax/errors.py EXIT_CODES): 2 config or usage
# error, 3 diverged, 4 processes disagree, 5 checkpoint error, 6 workdir busy, 7 an evaluation after
# training failed (its step is saved), 130 interrupted.
# A SIGINT/SIGTERM to the launcher itself (the user stopping it) stops everything, never restarts.
set -euo pipefail

dry_run=0
devices_per_process=2
max_restarts=0
restart_delay=5
max_restart_delay=300
usage="usage: launch/local.sh [--max-restarts=N] [--restart-delay=SECONDS] [--dry-run] [--devices-per-process N] NUM_PROCESSES <fbt-train args...>"
fail() { echo "local.sh: $1; $usage" >&2; exit 2; }
# An option's value, from `--name=value` or `--name value`; sets `value` and how many words it used.
option_value() {
  if [[ "$2" == *=* ]]; then value="${2#*=}"; used=1
  elif [[ $1 -ge 3 ]]; then value="$3"; used=2
  else fail "${2%%=*} needs a value"
  fi
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --devices-per-process|--devices-per-process=*)
      option_value $# "$@"
      [[ "$value" =~ ^[0-9]{1,6}$ ]] && ((10#$value >= 1)) || fail "--devices-per-process needs a positive integer (got '$value')"
      devices_per_process=$((10#$value)); shift "$used" ;;
    --max-restarts|--max-restarts=*)
      option_value $# "$@"
      [[ "$value" =~ ^[0-9]{1,6}$ ]] || fail "--max-restarts needs a non-negative integer (got '$value')"
      max_restarts=$((10#$value)); shift "$used" ;;
    --restart-delay|--restart-delay=*)
      option_value $# "$@"
      [[ "$value" =~ ^[0-9]{1,6}(\.[0-9]+)?$ ]] || fail "--restart-delay needs a number of seconds, 0 or more (got '$value')"
      restart_delay="$value"; shift "$used" ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || fail "NUM_PROCESSES is missing"
[[ "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || fail "NUM_PROCESSES must be a positive integer (got '$1')"
num_processes="$1"; shift

python=${PYTHON:-python3}
if command -v fbt-train >/dev/null 2>&1; then train=(fbt-train); else train=("$python" -m fbt_jax.train); fi

commands=()
make_commands() {  # every process's command, with a coordinator port free now
  local port i
  port=${FBT_COORDINATOR_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
  commands=()
  for ((i = 0; i < num_processes; i++)); do
    commands+=("env JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=${devices_per_process} \
${train[*]} $(printf '%q ' "$@")--config.distributed.coordinator_address=127.0.0.1:${port} \
--config.distributed.num_processes=${num_processes} --config.distributed.process_id=${i}")
  done
  for ((i = 0; i < num_processes; i++)); do echo "[local.sh] process $i: ${commands[$i]}"; done
}
if [[ $dry_run -eq 1 ]]; then make_commands "$@"; exit 0; fi

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
interrupted=0  # the launcher itself got SIGINT/SIGTERM: stop, never restart
signal_status=0
on_signal() { interrupted=1; signal_status=$1; stop_processes; }
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'stop_processes; rm -rf "$logdir"' EXIT

# One attempt: start every process, wait; the first failure stops the others. Sets `status` (0 when
# every process succeeded) and `failed` (the index of the process that failed first, or -1).
run_attempt() {
  local i pid t alive rc finished remaining running
  rm -f "$logdir"/*.pid "$logdir"/*.err
  job_pids=()
  for ((i = 0; i < num_processes; i++)); do
    # (the subshell's own stderr is dropped: bash's "Killed" notice for a process that died of a
    # signal; the failure line below says it)
    (bash -c "echo \$\$ > $(printf '%q' "$logdir/$i.pid"); exec ${commands[$i]}" 2>&1 1>&3 3>&- 4>&- \
      | "$python" -c "$relay" "$logdir/$i.err" 2>&4 3>&- 4>&-) 3>&1 4>&2 2>/dev/null &
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
  fi
  rm -f "$logdir"/*.pid  # ended: nothing of this attempt is signalled any more
}

# The failing process's last non-empty line (after the last carriage return of a progress bar).
last_line() { tr '\r' '\n' 2>/dev/null < "$logdir/$1.err" | grep -v '^[[:space:]]*$' | tail -n 1 || true; }
# Whether a failed attempt's status is worth another attempt (see the header).
retryable() { case "$1" in 2|3|4|5|6|7|130) return 1 ;; *) return 0 ;; esac; }
# What an attempt's end means, for the restart line.
describe_end() {
  local what="status $status" message
  if [[ $status -eq 75 ]]; then what="preempted"
  elif [[ $status -gt 128 && $status -lt 160 ]]; then what="killed by SIG$(kill -l $((status - 128)) 2>/dev/null || echo $((status - 128)))"
  fi
  if [[ $failed -ge 0 ]]; then
    message=$(last_line "$failed")
    echo "process $failed $what: ${message:-no message}"
  else
    echo "a process $what"
  fi
}
# The back-off before restart R (1, 2, ...): the delay doubled R-1 times, capped.
backoff() {
  awk -v d="$restart_delay" -v r="$1" -v cap="$max_restart_delay" \
    'BEGIN { if (d > cap) cap = d; x = d * 2 ^ (r - 1); if (x > cap) x = cap; printf "%.10g", x }'
}

attempts=$((max_restarts + 1))
for ((attempt = 1; ; attempt++)); do
  make_commands "$@"
  run_attempt
  if [[ $status -eq 0 ]]; then break; fi
  if [[ $interrupted -eq 0 && $attempt -lt $attempts ]] && retryable "$status"; then
    delay=$(backoff "$attempt")
    echo "local.sh: attempt $attempt/$attempts ended with status $status ($(describe_end)); restarting in $delay s" >&2
    sleep "$delay" &
    # A signal to the launcher interrupts the wait at once (its trap runs); one that came since the
    # message above (its trap already ran) must not be followed by the whole back-off.
    if [[ $interrupted -eq 0 ]]; then wait $! || true; fi
    kill $! 2>/dev/null || true
    if [[ $interrupted -eq 0 ]]; then continue; fi
    status=$signal_status
  fi
  if [[ $interrupted -eq 1 ]]; then
    echo "local.sh: interrupted; stopped the processes (the same command resumes from the last checkpoint saved)" >&2
    exit "$status"
  fi
  why=""
  if [[ $max_restarts -gt 0 ]]; then
    if retryable "$status"; then why=" (attempt $attempt/$attempts: no restarts left)"
    else why=" (attempt $attempt/$attempts: status $status is not retried)"
    fi
  fi
  if [[ $failed -ge 0 ]]; then
    message=$(last_line "$failed")
    echo "local.sh: process $failed exited with status $status: ${message:-no message}; stopped the others$why" >&2
  else
    echo "local.sh: a process exited with status $status; stopped the others$why" >&2
  fi
  exit "$status"
done
trap - EXIT INT TERM
rm -rf "$logdir"

#!/usr/bin/env bash
# Run fbt-train on every worker of a Cloud TPU VM slice (one process per host; JAX finds the
# other hosts from the TPU metadata, so no coordinator flags are needed).
#
#   launch/tpu_pod.sh [--dry-run] [--setup] TPU_NAME ZONE <fbt-train args...>
#   e.g. launch/tpu_pod.sh my-v5p-128 us-east5-a --config=configs/fbt_1b.py --config.workdir=gs://bucket/runs/1b
#
# PROGRAM=fbt-prepare runs fbt-prepare instead, one shard per host: each worker's shard index and
# the shard count come from the TPU metadata (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES), e.g.
#   PROGRAM=fbt-prepare launch/tpu_pod.sh my-v5p-128 us-east5-a --input='gs://b/corpus/*.jsonl.zst' ...
#
# PROGRAM=fbt-import runs fbt-import on every host (each reads only the tensor blocks its chips hold;
# the model directory must be on every host), e.g.
#   PROGRAM=fbt-import launch/tpu_pod.sh my-v5p-128 us-east5-a ~/Llama-3.2-1B gs://b/runs/llama-1b --fsdp=64
#
# --setup first copies this checkout to every worker and installs it (pip install -e .).
# --dry-run prints the gcloud commands without running them. Environment:
#   PROJECT        gcloud project (default: gcloud's configured one)
#   REMOTE_DIR     checkout location on the workers (default: ~/fbt-jax)
#   EXTRA_ENV      extra "VAR=value ..." to set on the workers (e.g. LIBTPU_INIT_ARGS=...)
#
# Relaunching after a preemption, without a person (docs/launch.md):
#   MAX_RESTARTS       relaunch at most this many times (default 0: run once)
#   RESTART_DELAY      seconds before the first relaunch (default 60), doubled at every relaunch
#   MAX_RESTART_DELAY  ... up to this (default 1800)
#   BEFORE_RELAUNCH    a shell command run before every relaunch (e.g. one that recreates a
#                      preempted spot slice and waits for it); its failure fails that attempt
# Every worker reports its program's exit status in one line (`[tpu_pod.sh] worker HOST exited with
# status S`), which decides (gcloud's own status does not carry the workers' reliably): a run is
# relaunched (on every worker, --setup included) after 75 (preempted: saved and stopped), a lost
# connection (ssh's 255: a host went away) or any other failure; it stops at once, with that
# status, after 0 or a status a relaunch cannot fix: 2 config error, 3 diverged, 4 processes
# disagree, 5 checkpoint error, 6 workdir busy, 7 evaluation failed (its step saved), 130 interrupted.
set -euo pipefail

dry_run=0; setup=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --setup) setup=1; shift ;;
    *) break ;;
  esac
done
if [[ $# -lt 2 ]]; then
  echo "usage: launch/tpu_pod.sh [--dry-run] [--setup] TPU_NAME ZONE <fbt-train args...>" >&2
  exit 2
fi
max_restarts=${MAX_RESTARTS:-0}
restart_delay=${RESTART_DELAY:-60}
max_restart_delay=${MAX_RESTART_DELAY:-1800}
[[ "$max_restarts" =~ ^[0-9]{1,6}$ ]] || { echo "tpu_pod.sh: MAX_RESTARTS must be a non-negative integer (got '$max_restarts')" >&2; exit 2; }
for value in "$restart_delay" "$max_restart_delay"; do
  [[ "$value" =~ ^[0-9]{1,6}(\.[0-9]+)?$ ]] || { echo "tpu_pod.sh: RESTART_DELAY and MAX_RESTART_DELAY must be numbers of seconds, 0 or more (got '$value')" >&2; exit 2; }
done
max_restarts=$((10#$max_restarts))
tpu="$1"; zone="$2"; shift 2
remote_dir=${REMOTE_DIR:-'~/fbt-jax'}
project_flag=()
[[ -n "${PROJECT:-}" ]] && project_flag=(--project "$PROJECT")
ssh=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" "${project_flag[@]}" --worker=all)

run() {
  echo "[tpu_pod.sh] $(printf '%q ' "$@")"
  [[ $dry_run -eq 1 ]] || "$@"
}

do_setup() {
  local here
  here=$(cd "$(dirname "$0")/.." && pwd)
  run gcloud compute tpus tpu-vm scp --recurse "$here" "$tpu:$remote_dir" --zone "$zone" "${project_flag[@]}" --worker=all
  run "${ssh[@]}" --command "cd $remote_dir && python3 -m pip install -q -e . 'jax[tpu]'"
}

program=${PROGRAM:-fbt-train}
case "$program" in
  fbt-train|fbt-import) worker_env="" ;;
  fbt-prepare)
    # A worker's number and the slice's hosts, from the metadata server (as JAX itself reads them).
    metadata='curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes'
    worker_env="export TPU_WORKER_ID=\${TPU_WORKER_ID:-\$($metadata/agent-worker-number)} TPU_WORKER_HOSTNAMES=\${TPU_WORKER_HOSTNAMES:-\$($metadata/worker-network-endpoints)} && "
    ;;
  *) echo "tpu_pod.sh: PROGRAM=$program is not fbt-train, fbt-import or fbt-prepare" >&2; exit 2 ;;
esac
# Unbuffered output so every host's progress shows up; only process 0 prints metrics. Each worker
# then reports its exit status in one line.
command="{ cd $remote_dir && ${worker_env}PYTHONUNBUFFERED=1 ${EXTRA_ENV:-} $program $(printf '%q ' "$@"); }; \
status=\$?; echo \"[tpu_pod.sh] worker \$(hostname) exited with status \$status\"; exit \$status"

if [[ $dry_run -eq 1 ]]; then
  [[ $setup -eq 0 ]] || do_setup
  run "${ssh[@]}" --command "$command"
  exit 0
fi

out=$(mktemp "${TMPDIR:-/tmp}/tpu_pod.XXXXXX")
interrupted=0
trap 'interrupted=1' INT TERM
trap 'rm -f "$out"' EXIT

# One attempt on every worker; sets `status` and `why` (for the relaunch line).
run_attempt() {
  local ssh_status reported final="" failed="" line
  status=0; why=""
  if [[ $attempt -gt 1 && -n "${BEFORE_RELAUNCH:-}" ]]; then
    echo "[tpu_pod.sh] before relaunch: $BEFORE_RELAUNCH"
    set +e; bash -c "$BEFORE_RELAUNCH"; status=$?; set -e
    if [[ $status -ne 0 ]]; then why="BEFORE_RELAUNCH failed"; return; fi
  fi
  if [[ $setup -eq 1 ]]; then
    set +e; (set -e; do_setup); status=$?; set -e
    if [[ $status -ne 0 ]]; then why="setup failed"; return; fi
  fi
  : > "$out"
  set +e
  run "${ssh[@]}" --command "$command" | tee "$out"
  ssh_status=${PIPESTATUS[0]}
  set -e
  reported=$(grep -o '\[tpu_pod\.sh\] worker [^ ]* exited with status [0-9]*' "$out" || true)
  while read -r line; do
    [[ -n "$line" ]] || continue
    local worker=${line#\[tpu_pod.sh\] worker }; worker=${worker%% *}
    local s=${line##* }
    if [[ -z "$final" ]] && final_status "$s"; then final="$s $worker"; fi
    if [[ -z "$failed" && $s -ne 0 ]]; then failed="$s $worker"; fi
  done <<< "$reported"
  if [[ -n "$final" ]]; then status=${final%% *}; why="worker ${final#* }: status $status"
  elif [[ -n "$failed" ]]; then
    status=${failed%% *}
    if [[ $status -eq 75 ]]; then why="worker ${failed#* }: preempted"; else why="worker ${failed#* }: status $status"; fi
  elif [[ $ssh_status -ne 0 ]]; then status=$ssh_status; why="gcloud/ssh exited with status $ssh_status: a host went away?"
  elif [[ -z "$reported" ]]; then status=255; why="no worker reported its exit status: the connection was lost"
  fi
}
# The statuses a relaunch cannot fix (fbt_jax/errors.py EXIT_CODES).
final_status() { case "$1" in 2|3|4|5|6|7|130) return 0 ;; *) return 1 ;; esac; }
backoff() {
  awk -v d="$restart_delay" -v r="$1" -v cap="$max_restart_delay" \
    'BEGIN { if (d > cap) cap = d; x = d * 2 ^ (r - 1); if (x > cap) x = cap; printf "%.10g", x }'
}

attempts=$((max_restarts + 1))
for ((attempt = 1; ; attempt++)); do
  run_attempt
  if [[ $status -eq 0 || $interrupted -eq 1 ]]; then exit "$status"; fi
  if final_status "$status"; then
    echo "tpu_pod.sh: attempt $attempt/$attempts ended with status $status ($why); not relaunched: a relaunch cannot fix it" >&2
    exit "$status"
  fi
  if [[ $attempt -ge $attempts ]]; then
    echo "tpu_pod.sh: attempt $attempt/$attempts ended with status $status ($why); no relaunches left (MAX_RESTARTS=$max_restarts)" >&2
    exit "$status"
  fi
  delay=$(backoff "$attempt")
  echo "tpu_pod.sh: attempt $attempt/$attempts ended with status $status ($why); relaunching in $delay s" >&2
  sleep "$delay" &
  wait $! || true  # a signal to the launcher interrupts the wait at once
  kill $! 2>/dev/null || true
  if [[ $interrupted -eq 1 ]]; then
    echo "tpu_pod.sh: interrupted; not relaunched" >&2
    exit "$status"
  fi
done

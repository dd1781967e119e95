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
tpu="$1"; zone="$2"; shift 2
remote_dir=${REMOTE_DIR:-'~/fbt-jax'}
project_flag=()
[[ -n "${PROJECT:-}" ]] && project_flag=(--project "$PROJECT")
ssh=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" "${project_flag[@]}" --worker=all)

run() {
  echo "[tpu_pod.sh] $(printf '%q ' "$@")"
  [[ $dry_run -eq 1 ]] || "$@"
}

if [[ $setup -eq 1 ]]; then
  here=$(cd "$(dirname "$0")/.." && pwd)
  run gcloud compute tpus tpu-vm scp --recurse "$here" "$tpu:$remote_dir" --zone "$zone" "${project_flag[@]}" --worker=all
  run "${ssh[@]}" --command "cd $remote_dir && python3 -m pip install -q -e . 'jax[tpu]'"
fi

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
# Unbuffered output so every host's progress shows up; only process 0 prints metrics.
command="cd $remote_dir && ${worker_env}PYTHONUNBUFFERED=1 ${EXTRA_ENV:-} $program $(printf '%q ' "$@")"
run "${ssh[@]}" --command "$command"

#!/usr/bin/env bash
# run.sh - run THERE, in the repo root of the device call: everything after the copy of the
# last vLLM bundle, so that a device command stays short:
#
#   cp .gpu/bundle-07.tar /root/stage/ && bash deploy/gpu/run.sh 'python3 -m tests.benchmarks.bench_gpu ...'
#
# 1. install the vLLM kit (.gpu/install-vllm.sh, or the copy inside the stack tars) unless
#    SITE already has vllm; no bundle-*.tar staged and no vllm: a warning, the command may
#    not need it;
# 2. install the stack kit (deploy/gpu/install-stack.sh; a no-op when already installed),
#    and the run-batch kit when .gpu/runbatch.tar came with the call (install-runbatch.sh);
# 3. export PYTHONPATH=SITE:<repo> VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
#    VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1, start the stack (stack-gpu.sh up: Kafka,
#    valkey, topics; its QBATCH_* exports);
# 4. with QBATCH_WORKERS=N: start N qbatch workers pinned to their own GPUs
#    (deploy/gpu/workers.sh; flags from QBATCH_WORKER_ARGS, GPUs per worker from
#    QBATCH_GPUS_PER_WORKER) and wait until all are ready;
# 5. run the command with bash -c, stop the workers and the stack (always), copy the
#    install logs, the stack's logs and the workers' (one file, workers.log) into
#    $OUT/gpu-logs; exit with the command's status.
#
# env: QBATCH_STAGE (/root/stage), SITE (/tmp/site), OUT (where logs go; default
#      /tmp/qbatch-gpu-out), QBATCH_KEEP_STACK=1 (leave Kafka/valkey running afterwards),
#      and every stack-gpu.sh / install-stack.sh variable (ports, partitions, GPU_HOME ...).
set -uo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
(($# >= 1)) || {
  echo "usage: bash deploy/gpu/run.sh '<command>'" >&2
  exit 2
}
CMD="$*"
STAGE=${QBATCH_STAGE:-/root/stage}
export SITE=${SITE:-/tmp/site}
export QBATCH_GPU_HOME=${QBATCH_GPU_HOME:-/tmp/kafka}
OUTDIR=${OUT:-/tmp/qbatch-gpu-out}
LOGS="$OUTDIR/gpu-logs"
mkdir -p "$LOGS"
t0=$SECONDS

log() { echo "run: [$((SECONDS - t0))s] $*" >&2; }
fail() {
  echo "run: ERROR: $*" >&2
  collect_logs
  exit 1
}
collect_logs() {
  cp -f "$QBATCH_GPU_HOME"/logs/*.log "$QBATCH_GPU_HOME"/logs/*.out "$QBATCH_GPU_HOME"/logs/*.err \
    "$LOGS/" 2>/dev/null || true
}

cd "$REPO_ROOT" || exit 1
shopt -s nullglob

# -- 1. vLLM kit
if [[ -f "$SITE/vllm/__init__.py" ]]; then
  log "vLLM already in $SITE"
else
  bundles=("$STAGE"/bundle-*.tar)
  if ((${#bundles[@]} == 0)); then
    log "WARNING: no vLLM in $SITE and no bundle-*.tar in $STAGE: continuing without vLLM"
  else
    installer=""
    for f in "$REPO_ROOT/.gpu/install-vllm.sh" "$STAGE/qbatch-stack/install-vllm.sh"; do
      [[ -f "$f" ]] && installer="$f" && break
    done
    if [[ -z "$installer" ]]; then # the stack tars hold a copy: unpack it
      for t in "$STAGE"/stack-*.tar; do
        tar -xf "$t" -C "$STAGE" qbatch-stack/install-vllm.sh 2>/dev/null && break
      done
      [[ -f "$STAGE/qbatch-stack/install-vllm.sh" ]] && installer="$STAGE/qbatch-stack/install-vllm.sh"
    fi
    [[ -n "$installer" ]] || fail "no install-vllm.sh: carry .gpu/install-vllm.sh"
    log "installing the vLLM kit (${#bundles[@]} bundles) into $SITE; log: $LOGS/install-vllm.log"
    SITE="$SITE" bash "$installer" "$STAGE" >"$LOGS/install-vllm.log" 2>&1 \
      || {
        tail -n 30 "$LOGS/install-vllm.log" >&2
        fail "vLLM kit install failed (all of bundle-01..NN copied into $STAGE?)"
      }
    log "vLLM kit installed"
  fi
fi

# -- 2. stack kit
log "installing the stack kit; log: $LOGS/install-stack.log"
bash "$SCRIPT_DIR/install-stack.sh" "$STAGE" >"$LOGS/install-stack.log" 2>&1 \
  || {
    tail -n 30 "$LOGS/install-stack.log" >&2
    fail "stack kit install failed (all of stack-01..NN copied into $STAGE?)"
  }

# -- 2b. the run-batch kit (deploy/gpu/stage-runbatch.sh), when its tar came with the call
if [[ -f "$REPO_ROOT/.gpu/runbatch.tar" || -f "$STAGE/runbatch.tar" ]]; then
  log "installing the run-batch kit; log: $LOGS/install-runbatch.log"
  SITE="$SITE" bash "$SCRIPT_DIR/install-runbatch.sh" >"$LOGS/install-runbatch.log" 2>&1 \
    || { # not fatal: the qbatch side of a benchmark still runs; run-batch will not
      tail -n 30 "$LOGS/install-runbatch.log" >&2
      log "WARNING: the run-batch kit did not install (or run_batch does not import)"
    }
fi

# -- 3. environment and stack
export PYTHONPATH="$SITE:$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
stop_stack() {
  if [[ -n "${QBATCH_WORKERS:-}" ]]; then
    bash "$SCRIPT_DIR/workers.sh" stop 2>>"$LOGS/stack.log" || true
    for f in "${QBATCH_WORKERS_DIR:-/tmp/qbatch-workers}"/w*.log; do
      echo "==== $f"
      cat "$f"
    done >"$LOGS/workers.log" 2>/dev/null
  fi
  if [[ "${QBATCH_KEEP_STACK:-0}" != 1 ]]; then
    bash "$SCRIPT_DIR/stack-gpu.sh" down 2>>"$LOGS/stack.log" || true
  fi
  collect_logs
}
trap stop_stack EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
env_lines="$(bash "$SCRIPT_DIR/stack-gpu.sh" up 2> >(tee -a "$LOGS/stack.log" >&2))" \
  || fail "stack-gpu.sh up failed (logs in $LOGS)"
eval "$env_lines"
log "stack up: $QBATCH_KAFKA_BOOTSTRAP $QBATCH_REDIS_URL"

# -- 4. pinned workers
if [[ -n "${QBATCH_WORKERS:-}" ]]; then
  log "starting $QBATCH_WORKERS workers x ${QBATCH_GPUS_PER_WORKER:-1} GPUs: ${QBATCH_WORKER_ARGS:-}"
  read -r -a worker_args <<<"${QBATCH_WORKER_ARGS:-}" # words, never globbed (nullglob is on)
  bash "$SCRIPT_DIR/workers.sh" start "$QBATCH_WORKERS" "${worker_args[@]}" \
    || fail "workers did not start (logs in ${QBATCH_WORKERS_DIR:-/tmp/qbatch-workers})"
  log "workers ready"
fi

# -- 5. the command
log "running: $CMD"
bash -c "$CMD"
rc=$?
log "command exited with $rc"
exit "$rc"

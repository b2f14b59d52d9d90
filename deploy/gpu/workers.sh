#!/usr/bin/env bash
# workers.sh - N qbatch workers on one host, each pinned to its own GPUs, in one consumer
# group: the data-parallel layout (N engines of tensor_parallel_size G) beside the
# tensor-parallel one (one worker, --tensor-parallel-size N*G).
#
#   bash deploy/gpu/workers.sh start N [qbatch-worker flags ...]   # waits until all are ready
#   bash deploy/gpu/workers.sh stop                                # SIGTERM, drain, then -9
#   bash deploy/gpu/workers.sh status
#
# Worker i (0-based) gets CUDA_VISIBLE_DEVICES = GPUs i*G .. i*G+G-1 of QBATCH_GPUS,
# (else of an inherited CUDA_VISIBLE_DEVICES, else of what nvidia-smi lists),
# QBATCH_TENSOR_PARALLEL_SIZE=G, QBATCH_WORKER_ID=<QBATCH_WORKER_ID_PREFIX>w<i> and
# QBATCH_METRICS_PORT=<QBATCH_METRICS_PORT_BASE>+i; everything else (topics, Redis, engine,
# model) comes from the caller's QBATCH_* environment and the flags, the same for all
# (flags that the script sets per worker are refused). Each worker is its own process
# group (setsid), so a kill -9 at the stop timeout takes its engine processes too.
# Why a script and not one process with N engines: a worker owns one engine, and the
# group's rebalancing already spreads partitions over workers (and moves them when one dies).
#
# env: QBATCH_GPUS_PER_WORKER (G, default 1), QBATCH_GPUS (comma-separated GPU ids to share
#      out; default: those nvidia-smi lists, else 0..N*G-1), QBATCH_WORKERS_DIR (logs and
#      pids; default /tmp/qbatch-workers), QBATCH_METRICS_PORT_BASE (9400),
#      QBATCH_WORKER_ID_PREFIX (""), QBATCH_WORKER_READY_TIMEOUT_S (900: a cold vLLM start
#      takes minutes), QBATCH_WORKER_STOP_TIMEOUT_S (150), PYTHON (python3).
#      "Ready" is /readyz answering 200 with partitions assigned, so a benchmark started
#      next finds every worker in the group; QBATCH_WORKER_WAIT_ASSIGNED=0 drops the
#      partitions condition (more workers than partitions: some stay without).
set -uo pipefail

DIR=${QBATCH_WORKERS_DIR:-/tmp/qbatch-workers}
PY=${PYTHON:-python3}
G=${QBATCH_GPUS_PER_WORKER:-1}
PORT_BASE=${QBATCH_METRICS_PORT_BASE:-9400}

say() { echo "workers: $*" >&2; }
die() {
  say "ERROR: $*"
  exit 2
}
usage() { die "usage: workers.sh start N [qbatch-worker flags ...] | stop | status"; }

pids() {
  shopt -s nullglob
  local f
  for f in "$DIR"/w*.pid; do
    echo "$(basename "$f" .pid) $(cat "$f")"
  done
}

alive() { kill -0 "$1" 2>/dev/null; }

is_worker() { # pid -> 0 when it is (still) one of ours, not a reused pid
  alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- '-m worker.cli'
}

ready() { # port -> 0 when /readyz answers 200 (and, unless told not to, with partitions)
  "$PY" - "$1" "${QBATCH_WORKER_WAIT_ASSIGNED:-1}" <<'EOF' 2>/dev/null
import json, sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/readyz", timeout=2) as r:
        detail = json.loads(r.read() or b"{}")
        ok = r.status == 200
except Exception:
    sys.exit(1)
sys.exit(0 if ok and (sys.argv[2] == "0" or detail.get("assigned_partitions", 0) > 0) else 1)
EOF
}

gpu_list() { # the GPU ids to share out, one per line
  if [[ -n "${QBATCH_GPUS:-${CUDA_VISIBLE_DEVICES:-}}" ]]; then
    tr ',' '\n' <<<"${QBATCH_GPUS:-$CUDA_VISIBLE_DEVICES}" | sed '/^$/d'
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index --format=csv,noheader
  else
    seq 0 $(($1 - 1))
  fi
}

start() {
  local n=${1:-}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || usage
  [[ "$G" =~ ^[1-9][0-9]*$ ]] || die "QBATCH_GPUS_PER_WORKER must be a positive integer, got '$G'"
  shift
  local flag
  for flag in "$@"; do
    case "$flag" in
      --metrics-port* | --worker-id* | --tensor-parallel-size*)
        die "$flag is set per worker by workers.sh (QBATCH_METRICS_PORT_BASE, QBATCH_WORKER_ID_PREFIX, QBATCH_GPUS_PER_WORKER)"
        ;;
    esac
  done
  mkdir -p "$DIR"
  if [[ -n "$(pids)" ]]; then
    die "workers already started in $DIR (workers.sh stop first)"
  fi
  rm -f "$DIR"/w*.log
  mapfile -t gpus < <(gpu_list $((n * G)))
  ((${#gpus[@]} >= n * G)) \
    || die "$n workers x $G GPUs need $((n * G)) GPUs; there are ${#gpus[@]} (${gpus[*]:-none})"
  local i devices
  for ((i = 0; i < n; i++)); do
    devices=$(
      IFS=,
      echo "${gpus[*]:$((i * G)):$G}"
    )
    CUDA_VISIBLE_DEVICES="$devices" \
      QBATCH_TENSOR_PARALLEL_SIZE="$G" \
      QBATCH_WORKER_ID="${QBATCH_WORKER_ID_PREFIX:-}w$i" \
      QBATCH_METRICS_PORT=$((PORT_BASE + i)) \
      setsid "$PY" -m worker.cli "$@" >"$DIR/w$i.log" 2>&1 </dev/null &
    echo $! >"$DIR/w$i.pid"
    say "w$i pid $! CUDA_VISIBLE_DEVICES=$devices metrics :$((PORT_BASE + i)) log $DIR/w$i.log"
  done
  local deadline=$((SECONDS + ${QBATCH_WORKER_READY_TIMEOUT_S:-900})) name pid waiting
  while :; do
    waiting=0
    while read -r name pid; do
      i=${name#w}
      if ! alive "$pid"; then
        tail -n 20 "$DIR/$name.log" >&2
        stop
        die "$name (pid $pid) exited before it was ready"
      fi
      ready $((PORT_BASE + i)) || waiting=$((waiting + 1))
    done < <(pids)
    ((waiting == 0)) && break
    if ((SECONDS >= deadline)); then
      stop
      die "$waiting of $n workers not ready after ${QBATCH_WORKER_READY_TIMEOUT_S:-900} s"
    fi
    sleep 1
  done
  say "$n workers ready"
}

stop() {
  # SIGTERM to the worker (it drains and stops its engine); kill -9 to its whole process
  # group (setsid at start), so an engine child process cannot keep holding a GPU.
  local name pid deadline
  while read -r name pid; do
    is_worker "$pid" && kill -TERM "$pid"
  done < <(pids)
  deadline=$((SECONDS + ${QBATCH_WORKER_STOP_TIMEOUT_S:-150}))
  while read -r name pid; do
    while is_worker "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
    if is_worker "$pid"; then
      say "$name (pid $pid) still running after the stop timeout: kill -9 (its process group)"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    else
      kill -KILL -- "-$pid" 2>/dev/null # what is left of its group (engine children)
      say "$name (pid $pid) stopped"
    fi
    rm -f "$DIR/$name.pid"
  done < <(pids)
}

status() {
  local name pid any=1
  while read -r name pid; do
    any=0
    if alive "$pid"; then say "$name pid $pid running"; else say "$name pid $pid gone"; fi
  done < <(pids)
  ((any == 0)) || say "none started in $DIR"
}

case "${1:-}" in
  start)
    shift
    start "$@"
    ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac

#!/usr/bin/env bash
# What is waiting for a GPU, one phase after another, each writing under $DIR as it ends
# (a budget running out still leaves the earlier ones). In the order the issues come:
#
#   0. (issue 42) `lanes`: bench_gpu lanes-start with the step cap off, 256 and 1024 on W,
#      then off and 256 on the night of job families; `smoke`: pytest tests/gpu (the step
#      cap's lane scheduler and the embeddings pool included). Not in the default list:
#      PHASES="lanes smoke full profile prefix embed" runs everything;
#   1. (issue 43) bench_gpu full --model 0.6b: raw LLM.generate (A) and the worker (C) on W, 6,000
#      requests, each engine in its own child process;
#   2. the worker (C) on 0.6B again under py-spy (--gil --threads, raw stacks): where the
#      GIL goes in the worker process at full load; summed by tests/benchmarks/profile_summary.py;
#   3. bench_gpu_prefix raw --night --sorted, then qbatch --night: the night of job
#      families in file order, sorted by family, and through `qbatch bulk run`; report;
#   4. (issue 44) bench_gpu_embed raw, qbatch, report on 0.6B then 14B in pooling mode:
#      20,000 inputs of 32-512 tokens, `LLM.embed` in one call against `qbatch bulk run`.
#
# Run it detached (it outlives one device call):
#   bash deploy/gpu/bg.sh start tput "bash deploy/gpu/throughput-runs.sh /tmp/t43"
# Phases: PHASES="full profile prefix embed" (default all), N (6000).
set -uo pipefail

DIR=${1:?usage: throughput-runs.sh DIR}
PHASES=${PHASES:-full profile prefix embed}
N=${N:-6000}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
log() { echo "throughput-runs: [$SECONDS s] $*"; }

for phase in $PHASES; do
  case $phase in
    full)
      log "full --model 0.6b --n $N"
      $PY -m tests.benchmarks.bench_gpu full --model 0.6b --n "$N" --b64 0 --b16 0 \
        --warmup 64 --budget-s 900 --out "$DIR/full-0.6b" || log "full exited $?"
      ;;
    profile)
      spy=$(command -v py-spy || echo "${SITE:-/tmp/site}/bin/py-spy")
      log "C on 0.6B under $spy"
      mkdir -p "$DIR/profile"
      "$spy" record --gil --threads -r 100 -f raw -o "$DIR/profile/c-0.6b.txt" -- \
        $PY -m tests.benchmarks.bench_gpu continuous --model 0.6b --n "$N" --lone 0 \
        --sweep 0 --warmup 64 --out "$DIR/profile" || log "profile exited $?"
      $PY -m tests.benchmarks.profile_summary "$DIR/profile/c-0.6b.txt" --top 30 \
        > "$DIR/profile/summary.md" || true
      ;;
    prefix)
      log "prefix: raw (file order and sorted), qbatch, report"
      B="$PY -m tests.benchmarks.bench_gpu_prefix"
      $B raw --out "$DIR/prefix" --warmup 64 --night --only N --sorted || log "raw exited $?"
      $B qbatch --out "$DIR/prefix" --warmup 64 --night --only N --placements prefix \
        || log "qbatch exited $?"
      $B report --out "$DIR/prefix" || true
      ;;
    lanes)
      log "lanes-start: W (off, cap256, cap1024), families (off, cap256)"
      $PY -m tests.benchmarks.bench_gpu lanes-start --n 800 --warmup 64 \
        --variants on,cap256,cap1024 --out "$DIR/lanes-w" || log "lanes W exited $?"
      $PY -m tests.benchmarks.bench_gpu lanes-start --warmup 64 --workload families \
        --variants on,cap256 --out "$DIR/lanes-families" || log "lanes families exited $?"
      ;;
    smoke)
      log "pytest tests/gpu"
      $PY -m pytest tests/gpu -q -p no:cacheprovider > "$DIR/smoke.txt" 2>&1 \
        || log "smoke exited $?"
      tail -3 "$DIR/smoke.txt"
      ;;
    embed)
      B="$PY -m tests.benchmarks.bench_gpu_embed"
      for model in 0.6b 14b; do
        log "embed $model: raw, qbatch, report"
        $B raw --out "$DIR/embed-$model" --model "$model" || log "raw exited $?"
        $B qbatch --out "$DIR/embed-$model" --model "$model" || log "qbatch exited $?"
        $B report --out "$DIR/embed-$model" || true
      done
      ;;
    *) log "unknown phase $phase"; exit 2 ;;
  esac
done
log "done"

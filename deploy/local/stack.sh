#!/usr/bin/env bash
# Local single-node Kafka (KRaft, from Maven Central jars) + Redis for qbatch.
#
#   deploy/local/stack.sh up [--quiet]   start (idempotent), wait healthy, create topics
#                                        (both lanes' requests topics, DLQ, qbatch.results
#                                        for workers that opt in with --results-topic, and
#                                        qbatch.tool-calls for tool loops),
#                                        print `export QBATCH_...=...` lines on stdout
#   deploy/local/stack.sh status         pids/ports/health; exit 0 if both up, 3 otherwise
#   deploy/local/stack.sh down [--wipe]  stop what `up` started (pid files); --wipe drops data
#   deploy/local/stack.sh reset          down --wipe
#   deploy/local/stack.sh env            print the export lines only (starts nothing)
#   deploy/local/stack.sh logs           tail the Kafka and Redis logs
#   deploy/local/stack.sh fetch          only fetch the Kafka jars into the cache
#
# `up --sasl` (or QBATCH_KAFKA_SASL=1) serves Kafka on a SASL_PLAINTEXT listener
# (mechanism PLAIN) instead of PLAINTEXT, and prints the QBATCH_KAFKA_SECURITY_PROTOCOL /
# _SASL_MECHANISM / _SASL_USERNAME / _SASL_PASSWORD exports the clients read.
#
# All progress goes to stderr; stdout carries only the export lines, so
#   eval "$(deploy/local/stack.sh up)"
# starts the stack and sets QBATCH_KAFKA_BOOTSTRAP / QBATCH_REDIS_URL in the caller.
# See deploy/local/README.md.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"

KAFKA_VERSION="${QBATCH_KAFKA_VERSION:-4.1.2}"
HOST=127.0.0.1
KAFKA_PORT="${QBATCH_KAFKA_PORT:-9092}"
CTRL_PORT="${QBATCH_KAFKA_CONTROLLER_PORT:-$((KAFKA_PORT + 1))}"
REDIS_PORT="${QBATCH_REDIS_PORT:-6379}"
REDIS_DB="${QBATCH_REDIS_DB:-0}"
TOPIC="${QBATCH_TOPIC:-qbatch.requests}"
BULK_TOPIC="${QBATCH_BULK_TOPIC:-qbatch.requests.bulk}" # the bulk priority lane
PARTITIONS="${QBATCH_PARTITIONS:-8}"
DLQ_TOPIC="${QBATCH_DLQ_TOPIC:-qbatch.requests.dlq}"
DLQ_PARTITIONS="${QBATCH_DLQ_PARTITIONS:-1}"
RESULTS_TOPIC="${QBATCH_RESULTS_TOPIC:-qbatch.results}" # created, not exported: opt in per worker
RESULTS_PARTITIONS="${QBATCH_RESULTS_PARTITIONS:-$PARTITIONS}"
TOOL_CALLS_TOPIC="${QBATCH_TOOL_CALLS_TOPIC:-qbatch.tool-calls}" # tool-loop turns (qbatch tools serve)
KAFKA_START_TIMEOUT="${QBATCH_KAFKA_START_TIMEOUT:-90}"
REDIS_START_TIMEOUT="${QBATCH_REDIS_START_TIMEOUT:-20}"
KAFKA_HEAP_OPTS="${QBATCH_KAFKA_HEAP_OPTS:--Xms256m -Xmx1g}"

STACK_DIR="${QBATCH_STACK_DIR:-$SCRIPT_DIR/.cache}"
JAR_DIR="${QBATCH_KAFKA_JAR_DIR:-$STACK_DIR/jars/kafka-$KAFKA_VERSION}" # kept by down/reset
# A private stack dir (tests) reuses the default jar cache when it has the jars.
if [[ -z "${QBATCH_KAFKA_JAR_DIR:-}" && ! -f "$JAR_DIR/.complete" \
  && -f "$SCRIPT_DIR/.cache/jars/kafka-$KAFKA_VERSION/.complete" ]]; then
  JAR_DIR="$SCRIPT_DIR/.cache/jars/kafka-$KAFKA_VERSION"
fi
RUN_DIR="$STACK_DIR/run"                          # run data: logs, kafka data, redis dir
K_DIR="$RUN_DIR/kafka"
R_DIR="$RUN_DIR/redis"
K_PID="$K_DIR/kafka.pid"
R_PID="$R_DIR/redis.pid"

BOOTSTRAP="$HOST:$KAFKA_PORT"

# SASL/PLAIN (optional): `up --sasl` or QBATCH_KAFKA_SASL=1. The password is generated
# once per run dir (kept in $RUN_DIR/kafka/sasl.password) unless QBATCH_KAFKA_SASL_PASSWORD
# is given. The controller listener stays PLAINTEXT on 127.0.0.1.
SASL="${QBATCH_KAFKA_SASL:-0}"
SASL_USER="${QBATCH_KAFKA_SASL_USERNAME:-qbatch}"
SASL_PASS_FILE="$K_DIR/sasl.password"
SASL_PASS="${QBATCH_KAFKA_SASL_PASSWORD:-}"
SASL_ADMIN_PASS=""
REDIS_URL="redis://$HOST:$REDIS_PORT/$REDIS_DB"

QUIET=0
log() { [[ $QUIET == 1 ]] || echo "stack: $*" >&2; }
die() {
  echo "stack: ERROR: $*" >&2
  exit 1
}

# ---------------------------------------------------------------- helpers

# pid_alive, read_pid, port_open, our_pid
# shellcheck source=deploy/local/proc.sh
source "$SCRIPT_DIR/proc.sh"

# pid of our Kafka if running (pid file + command line check), else empty
kafka_pid() { our_pid "$K_PID" "kafka.Kafka $K_DIR/server.properties"; }

# pid of our Redis if running, else empty (never the system redis: we only trust our pid file)
redis_pid() { our_pid "$R_PID" "redis-server"; }

pick_python() {
  local py
  for py in "${QBATCH_PYTHON:-}" "$REPO_ROOT/.venv/bin/python" python3; do
    [[ -n "$py" ]] || continue
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import kafka' >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

java_cp() { java $KAFKA_HEAP_OPTS_TOOL -cp "$JAR_DIR/*" "$@"; }
KAFKA_HEAP_OPTS_TOOL="-Xmx256m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile=$K_DIR/log4j2-tools.properties"

tail_log() {
  local f="$1"
  if [[ -f "$f" ]]; then
    echo "----- last lines of $f -----" >&2
    tail -n "${2:-40}" "$f" >&2 || true
    echo "-----" >&2
  fi
}

need_cmd() { command -v "$1" >/dev/null 2>&1; }

ensure_tools() {
  local missing=()
  need_cmd java || missing+=(openjdk-17-jre-headless)
  need_cmd mvn || [[ -f "$JAR_DIR/.complete" ]] || missing+=(maven)
  need_cmd redis-server || missing+=(redis-server)
  need_cmd redis-cli || missing+=(redis-tools)
  need_cmd flock || missing+=(util-linux)
  if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && need_cmd apt-get; then
      log "installing ${missing[*]} with apt-get"
      apt-get update -qq >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
      # Debian may start the packaged redis service; we never use or stop it.
    else
      die "missing ${missing[*]}: install them (apt-get install ${missing[*]})"
    fi
  fi
}

sasl_on() { [[ "$SASL" == 1 || "$SASL" == true || "$SASL" == yes ]]; }

# Sets SASL_PASS (from the env, else the run dir's file, else a new random one) and
# SASL_ADMIN_PASS (inter-broker user, derived from the same file).
sasl_secrets() {
  mkdir -p "$K_DIR"
  if [[ -z "$SASL_PASS" ]]; then
    if [[ ! -s "$SASL_PASS_FILE" ]]; then
      (umask 077 && head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$SASL_PASS_FILE")
    fi
    SASL_PASS="$(cat "$SASL_PASS_FILE")"
  fi
  SASL_ADMIN_PASS="admin-$(printf '%s' "$SASL_PASS" | sha256sum | cut -c1-24)"
}

# kafka_ctl.py, with SASL client settings when the stack runs with --sasl
kafka_ctl() {
  local py="$1"
  shift
  if sasl_on; then
    sasl_secrets
    QBATCH_CTL_USER="$SASL_USER" QBATCH_CTL_PASS="$SASL_PASS" "$py" -c '
import os, sys
sys.path.insert(0, sys.argv[1])
import kafka_ctl
from kafka import KafkaAdminClient
def _admin(bootstrap, timeout_s):
    return KafkaAdminClient(
        bootstrap_servers=bootstrap, client_id="qbatch-stack",
        request_timeout_ms=int(max(timeout_s, 2) * 1000),
        bootstrap_timeout_ms=int(max(timeout_s, 2) * 1000),
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
        sasl_plain_username=os.environ["QBATCH_CTL_USER"],
        sasl_plain_password=os.environ["QBATCH_CTL_PASS"])
kafka_ctl._admin = _admin
sys.exit(kafka_ctl.main(sys.argv[2:]))
' "$SCRIPT_DIR" "$@"
  else
    "$py" "$SCRIPT_DIR/kafka_ctl.py" "$@"
  fi
}

fetch_jars() {
  if [[ -f "$JAR_DIR/.complete" ]]; then
    return 0
  fi
  need_cmd mvn || die "mvn not found (apt-get install maven)"
  log "fetching org.apache.kafka:kafka_2.13:$KAFKA_VERSION and its runtime dependencies (Maven Central)"
  local tmp="$JAR_DIR.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  if ! mvn -B -q -f "$SCRIPT_DIR/pom.xml" \
    -Dkafka.version="$KAFKA_VERSION" \
    org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$tmp" >"$tmp.mvn.log" 2>&1; then
    tail_log "$tmp.mvn.log" 60
    rm -rf "$tmp"
    die "maven could not fetch the Kafka $KAFKA_VERSION jars"
  fi
  rm -f "$tmp.mvn.log"
  [[ -f "$tmp/kafka_2.13-$KAFKA_VERSION.jar" ]] || die "kafka_2.13-$KAFKA_VERSION.jar missing after fetch"
  date -u +%FT%TZ >"$tmp/.complete"
  rm -rf "$JAR_DIR"
  mv "$tmp" "$JAR_DIR"
  log "jars in $JAR_DIR ($(find "$JAR_DIR" -name '*.jar' | wc -l) files)"
}

listener_config() {
  if sasl_on; then
    cat <<EOF
listeners=SASL_PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$CTRL_PORT
advertised.listeners=SASL_PLAINTEXT://$HOST:$KAFKA_PORT
listener.security.protocol.map=SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=SASL_PLAINTEXT
sasl.enabled.mechanisms=PLAIN
sasl.mechanism.inter.broker.protocol=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="$SASL_ADMIN_PASS" user_admin="$SASL_ADMIN_PASS" user_$SASL_USER="$SASL_PASS";
EOF
  else
    cat <<EOF
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$CTRL_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
EOF
  fi
}

write_kafka_config() {
  mkdir -p "$K_DIR/data" "$K_DIR/logs"
  if sasl_on; then sasl_secrets; fi
  (umask 077 && : >"$K_DIR/server.properties")
  cat >"$K_DIR/server.properties" <<EOF
# generated by deploy/local/stack.sh; edits are overwritten on the next \`up\`
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CTRL_PORT
$(listener_config)
controller.listener.names=CONTROLLER
log.dirs=$K_DIR/data
num.network.threads=2
num.io.threads=4
EOF
  cat "$SCRIPT_DIR/kafka/broker-common.properties" >>"$K_DIR/server.properties"
  # Logging set-up shared with deploy/gpu/stack-gpu.sh: the broker logs to a rolling
  # file, the one-shot tools (storage format, topics) only warn on stderr.
  cp "$SCRIPT_DIR/kafka/log4j2.properties" "$SCRIPT_DIR/kafka/log4j2-tools.properties" "$K_DIR/"
}

format_kafka() {
  if [[ -f "$K_DIR/data/meta.properties" ]]; then
    return 0
  fi
  local cid
  cid="$(java_cp kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n1)"
  [[ -n "$cid" ]] || die "could not generate a Kafka cluster id"
  log "formatting Kafka storage (cluster id $cid)"
  if ! java_cp kafka.tools.StorageTool format -t "$cid" -c "$K_DIR/server.properties" \
    >"$K_DIR/logs/format.log" 2>&1; then
    tail_log "$K_DIR/logs/format.log"
    die "kafka storage format failed"
  fi
  echo "$cid" >"$K_DIR/cluster.id"
  echo "$KAFKA_VERSION" >"$K_DIR/kafka.version"
}

start_kafka() {
  local pid
  pid="$(kafka_pid)"
  if [[ -n "$pid" ]]; then
    log "kafka already running (pid $pid)"
    return 0
  fi
  rm -f "$K_PID"
  if port_open "$KAFKA_PORT" || port_open "$CTRL_PORT"; then
    die "port $KAFKA_PORT or $CTRL_PORT on $HOST is in use by a process that is not ours (set QBATCH_KAFKA_PORT / QBATCH_KAFKA_CONTROLLER_PORT)"
  fi
  fetch_jars
  write_kafka_config
  if [[ -f "$K_DIR/kafka.version" && "$(cat "$K_DIR/kafka.version")" != "$KAFKA_VERSION" ]]; then
    log "WARNING: data dir was formatted by Kafka $(cat "$K_DIR/kafka.version"), now $KAFKA_VERSION (use \`reset\` if it fails)"
  fi
  format_kafka
  log "starting kafka $KAFKA_VERSION on $BOOTSTRAP (controller $HOST:$CTRL_PORT)"
  # setsid: own session/process group, so `down` can signal the whole group
  # shellcheck disable=SC2086
  setsid java $KAFKA_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent \
    -Djava.awt.headless=true \
    -Dkafka.logs.dir="$K_DIR/logs" \
    -Dlog4j2.configurationFile="$K_DIR/log4j2.properties" \
    -cp "$JAR_DIR/*" kafka.Kafka "$K_DIR/server.properties" \
    >"$K_DIR/logs/kafka.out" 2>&1 </dev/null 9>&- &
  echo $! >"$K_PID"
}

start_redis() {
  local pid
  pid="$(redis_pid)"
  if [[ -n "$pid" ]]; then
    log "redis already running (pid $pid)"
    return 0
  fi
  rm -f "$R_PID"
  if port_open "$REDIS_PORT"; then
    die "port $REDIS_PORT on $HOST is in use by a process that is not ours (system redis? set QBATCH_REDIS_PORT)"
  fi
  mkdir -p "$R_DIR/data"
  log "starting redis on $HOST:$REDIS_PORT"
  : >"$R_DIR/redis.log"
  if ! redis-server --bind "$HOST" --port "$REDIS_PORT" --protected-mode yes \
    --daemonize yes --pidfile "$R_PID" --logfile "$R_DIR/redis.log" \
    --dir "$R_DIR/data" --save '' --appendonly no --databases 16 9>&-; then
    tail_log "$R_DIR/redis.log"
    die "redis-server failed to start"
  fi
}

wait_redis() {
  local deadline=$((SECONDS + REDIS_START_TIMEOUT))
  while ((SECONDS < deadline)); do
    if [[ "$(redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null || true)" == PONG ]]; then
      if [[ -n "$(redis_pid)" ]]; then
        log "redis healthy (pid $(redis_pid))"
        return 0
      fi
    fi
    sleep 0.2
  done
  tail_log "$R_DIR/redis.log"
  die "redis did not answer PING on $HOST:$REDIS_PORT within ${REDIS_START_TIMEOUT}s"
}

kafka_healthy() { # $1 = timeout seconds
  local py
  if py="$(pick_python)"; then
    kafka_ctl "$py" wait --bootstrap "$BOOTSTRAP" --timeout "$1" 2>"$K_DIR/logs/health.err" >&2 \
      && return 0
    cat "$K_DIR/logs/health.err" >&2
    return 1
  fi
  # no kafka-python anywhere: port check, then Kafka's own TopicCommand --list
  local deadline=$((SECONDS + $1))
  while ((SECONDS < deadline)); do
    if port_open "$KAFKA_PORT" && java_cp org.apache.kafka.tools.TopicCommand \
      --bootstrap-server "$BOOTSTRAP" --list >/dev/null 2>&1; then
      return 0
    fi
    sleep 1
  done
  return 1
}

wait_kafka() {
  local deadline=$((SECONDS + KAFKA_START_TIMEOUT))
  # wait for the port first (cheap), watching that the JVM stays alive
  while ((SECONDS < deadline)); do
    if [[ -z "$(kafka_pid)" ]]; then
      tail_log "$K_DIR/logs/kafka.out"
      tail_log "$K_DIR/logs/server.log"
      die "kafka exited during startup (logs: $K_DIR/logs)"
    fi
    port_open "$KAFKA_PORT" && break
    sleep 0.3
  done
  local left=$((deadline - SECONDS))
  ((left > 0)) || left=1
  if ! kafka_healthy "$left"; then
    tail_log "$K_DIR/logs/server.log"
    die "kafka did not answer metadata requests on $BOOTSTRAP within ${KAFKA_START_TIMEOUT}s (logs: $K_DIR/logs)"
  fi
  log "kafka healthy (pid $(kafka_pid))"
}

ensure_topics() {
  local py
  if py="$(pick_python)"; then
    kafka_ctl "$py" topics --bootstrap "$BOOTSTRAP" --timeout 30 \
      "$TOPIC:$PARTITIONS" "$BULK_TOPIC:$PARTITIONS" "$DLQ_TOPIC:$DLQ_PARTITIONS" \
      "$RESULTS_TOPIC:$RESULTS_PARTITIONS" "$TOOL_CALLS_TOPIC:$PARTITIONS" \
      2>&1 | sed 's/^/stack: /' >&2
    return "${PIPESTATUS[0]}"
  fi
  local t p
  for t in "$TOPIC:$PARTITIONS" "$BULK_TOPIC:$PARTITIONS" "$DLQ_TOPIC:$DLQ_PARTITIONS" \
    "$RESULTS_TOPIC:$RESULTS_PARTITIONS" "$TOOL_CALLS_TOPIC:$PARTITIONS"; do
    p="${t##*:}"
    t="${t%:*}"
    java_cp org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP" --create \
      --if-not-exists --topic "$t" --partitions "$p" --replication-factor 1 >&2
    log "topic $t ready"
  done
}

print_env() {
  cat <<EOF
export QBATCH_KAFKA_BOOTSTRAP=$BOOTSTRAP
export QBATCH_REDIS_URL=$REDIS_URL
export QBATCH_TOPIC=$TOPIC
export QBATCH_BULK_TOPIC=$BULK_TOPIC
export QBATCH_DLQ_TOPIC=$DLQ_TOPIC
export QBATCH_TOOL_CALLS_TOPIC=$TOOL_CALLS_TOPIC
EOF
  if sasl_on; then
    sasl_secrets
    cat <<EOF
export QBATCH_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT
export QBATCH_KAFKA_SASL_MECHANISM=PLAIN
export QBATCH_KAFKA_SASL_USERNAME=$SASL_USER
export QBATCH_KAFKA_SASL_PASSWORD=$SASL_PASS
EOF
  fi
}

stop_pid() { # $1 name, $2 pid, $3 signal target ("group" or "pid")
  local name="$1" pid="$2" how="$3" i
  log "stopping $name (pid $pid)"
  if [[ $how == group ]]; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  else
    kill -TERM "$pid" 2>/dev/null || true
  fi
  for ((i = 0; i < 300; i++)); do # 30 s
    pid_alive "$pid" || return 0
    sleep 0.1
  done
  log "$name did not stop in 30s, sending KILL"
  if [[ $how == group ]]; then
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    pid_alive "$pid" || return 0
    sleep 0.1
  done
  die "$name (pid $pid) is still alive"
}

lock() {
  mkdir -p "$STACK_DIR"
  exec 9>"$STACK_DIR/.lock"
  flock -w 180 9 || die "another stack.sh has held $STACK_DIR/.lock for 180s"
}

# ---------------------------------------------------------------- commands

cmd_up() {
  local t0=$SECONDS
  ensure_tools
  lock
  mkdir -p "$K_DIR/logs" "$R_DIR"
  start_redis
  start_kafka
  wait_redis
  wait_kafka
  ensure_topics || die "topic creation failed"
  (umask 077 && print_env >"$RUN_DIR/env.sh" && chmod 600 "$RUN_DIR/env.sh")
  log "up in $((SECONDS - t0))s; settings in $RUN_DIR/env.sh"
  print_env
}

cmd_status() {
  local ok=0 kp rp
  kp="$(kafka_pid)"
  rp="$(redis_pid)"
  if [[ -n "$kp" ]]; then
    if kafka_healthy 5 >/dev/null 2>&1; then
      echo "kafka: running pid=$kp bootstrap=$BOOTSTRAP controller=$HOST:$CTRL_PORT version=$KAFKA_VERSION healthy"
    else
      echo "kafka: running pid=$kp bootstrap=$BOOTSTRAP NOT answering metadata requests"
      ok=3
    fi
  else
    echo "kafka: not running (pid file $K_PID)"
    ok=3
  fi
  if [[ -n "$rp" ]]; then
    if [[ "$(redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null || true)" == PONG ]]; then
      echo "redis: running pid=$rp url=$REDIS_URL healthy"
    else
      echo "redis: running pid=$rp url=$REDIS_URL NOT answering PING"
      ok=3
    fi
  else
    echo "redis: not running (pid file $R_PID)"
    ok=3
  fi
  echo "logs:  $K_DIR/logs/server.log  $R_DIR/redis.log"
  return $ok
}

cmd_down() {
  local wipe=0 pid
  [[ "${1:-}" == --wipe ]] && wipe=1
  lock
  pid="$(kafka_pid)"
  if [[ -n "$pid" ]]; then stop_pid kafka "$pid" group; else log "kafka not running"; fi
  rm -f "$K_PID"
  pid="$(redis_pid)"
  if [[ -n "$pid" ]]; then stop_pid redis "$pid" pid; else log "redis not running"; fi
  rm -f "$R_PID"
  if ((wipe)); then
    log "wiping run data $RUN_DIR (jar cache kept)"
    rm -rf "$RUN_DIR"
  fi
  log "down"
}

usage() {
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# flags each command takes; anything else is refused (a mistyped or unsupported flag
# such as `up --brokers 3` must not silently start the default stack)
allowed_flags() {
  case "$1" in
    up) echo "--quiet -q --sasl" ;;
    down) echo "--quiet -q --wipe" ;;
    *) echo "--quiet -q" ;;
  esac
}

main() {
  local cmd="${1:-}"
  shift || true
  local args=() allowed
  allowed=" $(allowed_flags "$cmd") "
  for a in "$@"; do
    if [[ "$allowed" != *" $a "* ]]; then
      echo "stack: ERROR: '$cmd' does not take '$a' (it takes:$(allowed_flags "$cmd" | sed 's/^/ /'))" >&2
      exit 2
    fi
    case "$a" in
      --quiet | -q) QUIET=1 ;;
      --sasl) SASL=1 ;;
      *) args+=("$a") ;;
    esac
  done
  case "$cmd" in
    up) cmd_up ;;
    status) cmd_status ;;
    down) cmd_down "${args[@]}" ;;
    reset) cmd_down --wipe ;;
    env) print_env ;;
    fetch)
      ensure_tools
      lock
      fetch_jars
      ;;
    logs)
      tail -n 50 "$K_DIR/logs/server.log" "$R_DIR/redis.log" 2>/dev/null || true
      ;;
    -h | --help | help) usage ;;
    *) usage ;;
  esac
}

main "$@"

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
# Cluster modes, next to (never instead of) the single-node stack:
#   deploy/local/stack.sh up --brokers 3 [--redis-cluster]
#                 --brokers 3: three KRaft nodes (broker+controller each) on 127.0.0.1:19092-19094
#                 (controllers 19192-19194), replication factor 3, min.insync.replicas=2;
#                 --redis-cluster: six cluster-enabled redis-server on 17000-17005 (3 masters,
#                 1 replica each). Either flag alone is fine; the exports point at the cluster
#                 parts asked for and the single-node stack for the rest (.cache/run/cluster-env.sh)
#   deploy/local/stack.sh env --brokers 3 [--redis-cluster]   the cluster's export lines only
#   deploy/local/stack.sh status --cluster       the cluster only; exit 0 if all of it is up
#   deploy/local/stack.sh down --cluster [--wipe]   stop (wipe) the cluster only; plain `down`
#                                        stops the cluster AND the single-node stack
#   deploy/local/stack.sh kill-broker N | stop-broker N | start-broker N   chaos: SIGKILL /
#                 SIGTERM / start again cluster Kafka node N (1-3); start waits until it serves
#   deploy/local/stack.sh kill-redis PORT | start-redis PORT   the same for one cluster Redis node
#   deploy/local/stack.sh logs --cluster   tail the cluster's logs
#
# Redis Sentinel mode (deploy/local/sentinel.sh), next to the others:
#   deploy/local/stack.sh up --redis-sentinel [--brokers 3]   a master + two replicas on
#                 127.0.0.1:16479-16481 and three sentinels on 26479-26481 (service `qbatch`);
#                 QBATCH_REDIS_URL=redis+sentinel://...; written to .cache/run/sentinel-env.sh
#   deploy/local/stack.sh kill-redis PORT | start-redis PORT   also for 16479-16481
#   deploy/local/stack.sh status --sentinel | down --sentinel [--wipe]   that set only
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

# Cluster modes (`up --brokers 3`, `up --redis-cluster`): own ports, own run dir.
CLUSTER_BROKERS=3
CR_NODES=6
CK_PORT="${QBATCH_CLUSTER_KAFKA_PORT:-19092}"            # node n: CK_PORT + n - 1
CC_PORT="${QBATCH_CLUSTER_CONTROLLER_PORT:-19192}"       # node n: CC_PORT + n - 1
CR_PORT="${QBATCH_CLUSTER_REDIS_PORT:-17000}"            # CR_PORT .. CR_PORT + 5 (bus: + 10000)
CR_NODE_TIMEOUT="${QBATCH_CLUSTER_REDIS_NODE_TIMEOUT:-5000}" # ms before a replica takes over
CLUSTER_HEAP_OPTS="${QBATCH_CLUSTER_KAFKA_HEAP_OPTS:--Xms128m -Xmx512m}"
CLUSTER_START_TIMEOUT="${QBATCH_CLUSTER_START_TIMEOUT:-180}"
C_DIR="$RUN_DIR/cluster"
CLUSTER_ENV="$RUN_DIR/cluster-env.sh"
# every node as a seed: a client that starts while one node is down still finds the cluster
CLUSTER_REDIS_URL="redis+cluster://$(for ((i = 0; i < CR_NODES; i++)); do printf '%s%s:%s' "${i:+,}" "$HOST" "$((CR_PORT + i))"; done | sed 's/^,//')/0"
WANT_BROKERS=1  # up/env --brokers N (1 or 3)
WANT_RCLUSTER=0 # up/env --redis-cluster
WANT_RSENTINEL=0 # up/env --redis-sentinel
CLUSTER_ONLY=0  # status/down/logs --cluster
SENTINEL_ONLY=0 # status/down --sentinel
TARGET=""       # kill-broker N, start-redis PORT, ...

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
# shellcheck source=deploy/local/sentinel.sh
source "$SCRIPT_DIR/sentinel.sh"

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
    >"$K_DIR/logs/kafka.out" 2>&1 </dev/null 8>&- 9>&- &
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
    --dir "$R_DIR/data" --save '' --appendonly no --databases 16 8>&- 9>&-; then
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
  # wait for the port first (cheap), watching that the JVM stays alive. Only the pid
  # we just wrote is checked, not kafka_pid's command line: until the forked shell has
  # exec'd java, that line still reads `bash stack.sh`, and a first check landing there
  # declared a starting broker dead (seen 2026-12-06 on a fresh machine)
  while ((SECONDS < deadline)); do
    if ! pid_alive "$(read_pid "$K_PID")"; then
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

ensure_topics() { # [bootstrap] [replication factor]
  local py bootstrap="${1:-$BOOTSTRAP}" rf="${2:-1}"
  if py="$(pick_python)"; then
    kafka_ctl "$py" topics --bootstrap "$bootstrap" --timeout 30 --replication-factor "$rf" \
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
    java_cp org.apache.kafka.tools.TopicCommand --bootstrap-server "$bootstrap" --create \
      --if-not-exists --topic "$t" --partitions "$p" --replication-factor "$rf" >&2
    log "topic $t ready"
  done
}

print_env() { # [bootstrap] [redis url]
  cat <<EOF
export QBATCH_KAFKA_BOOTSTRAP=${1:-$BOOTSTRAP}
export QBATCH_REDIS_URL=${2:-$REDIS_URL}
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

# ---------------------------------------------------------------- cluster mode

# fd 8; always taken before the single-stack lock (fd 9), never after. Every long-lived
# process started here closes both (8>&- 9>&-), or it would hold the lock for good.
cluster_lock() {
  mkdir -p "$STACK_DIR"
  exec 8>"$STACK_DIR/.cluster.lock"
  flock -w 300 8 || die "another stack.sh has held $STACK_DIR/.cluster.lock for 300s"
}

join_by_comma() { (IFS=, && echo "$*"); }

ck_nodes() { seq 1 "$CLUSTER_BROKERS"; }
cr_ports() { seq "$CR_PORT" $((CR_PORT + CR_NODES - 1)); }
ck_dir() { echo "$C_DIR/kafka-$1"; }
cr_dir() { echo "$C_DIR/redis-$1"; }

cluster_bootstrap() {
  local n out=()
  for n in $(ck_nodes); do out+=("$HOST:$((CK_PORT + n - 1))"); done
  join_by_comma "${out[@]}"
}
CLUSTER_BOOTSTRAP="$(cluster_bootstrap)"

# pid of cluster Kafka node $1 / cluster Redis on port $1 if running (pid file + command line)
ck_pid() {
  local d
  d="$(ck_dir "$1")"
  our_pid "$d/kafka.pid" "kafka.Kafka $d/server.properties"
}
cr_pid() { our_pid "$(cr_dir "$1")/redis.pid" "redis-server $HOST:$1"; }

cr_cli() { # PORT ARGS...: redis-cli against one cluster node, CRs stripped, errors silenced
  local port="$1"
  shift
  redis-cli -h "$HOST" -p "$port" "$@" 2>/dev/null | tr -d '\r' || true
}
cr_info() { cr_cli "$1" cluster info | sed -n "s/^$2://p"; } # cr_info PORT FIELD

# wait_gone SECONDS PID...: 0 once every pid has exited (a zombie counts as gone)
wait_gone() {
  local limit=$(($1 * 10)) i pid left
  shift
  for ((i = 0; i < limit; i++)); do
    left=0
    for pid in "$@"; do
      if pid_alive "$pid" && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]]; then
        left=1
      fi
    done
    ((left)) || return 0
    sleep 0.1
  done
  return 1
}

check_broker_arg() {
  if ! [[ "$1" =~ ^[0-9]+$ ]] || (($1 < 1 || $1 > CLUSTER_BROKERS)); then
    die "cluster Kafka node must be 1..$CLUSTER_BROKERS, not '$1'"
  fi
}
check_redis_arg() {
  if ! [[ "$1" =~ ^[0-9]+$ ]] || (($1 < CR_PORT || $1 >= CR_PORT + CR_NODES)); then
    die "cluster Redis port must be $CR_PORT..$((CR_PORT + CR_NODES - 1)), not '$1'"
  fi
}

write_ck_config() { # node
  local n="$1" d voters=() v
  d="$(ck_dir "$n")"
  mkdir -p "$d/data" "$d/logs"
  for v in $(ck_nodes); do voters+=("$v@$HOST:$((CC_PORT + v - 1))"); done
  cat >"$d/server.properties" <<EOF
# generated by deploy/local/stack.sh up --brokers $CLUSTER_BROKERS; edits are overwritten on the next \`up\`
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$(join_by_comma "${voters[@]}")
listeners=PLAINTEXT://$HOST:$((CK_PORT + n - 1)),CONTROLLER://$HOST:$((CC_PORT + n - 1))
advertised.listeners=PLAINTEXT://$HOST:$((CK_PORT + n - 1))
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
log.dirs=$d/data
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
EOF
  cat "$SCRIPT_DIR/kafka/broker-cluster.properties" >>"$d/server.properties"
  cp "$SCRIPT_DIR/kafka/log4j2.properties" "$d/"
}

# One cluster id for all nodes (kept in $C_DIR/kafka-cluster.id); every node not yet
# formatted is formatted with it, in parallel.
format_cluster() {
  local n d cid pids=() nodes=() i failed=0
  cp "$SCRIPT_DIR/kafka/log4j2-tools.properties" "$C_DIR/"
  if [[ ! -s "$C_DIR/kafka-cluster.id" ]]; then
    cid="-" # a Kafka Uuid: 16 random bytes, URL-safe base64 without padding, no leading '-'
    while [[ "$cid" == -* ]]; do
      cid="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
    done
    echo "$cid" >"$C_DIR/kafka-cluster.id"
  fi
  cid="$(cat "$C_DIR/kafka-cluster.id")"
  for n in $(ck_nodes); do
    d="$(ck_dir "$n")"
    [[ -f "$d/data/meta.properties" ]] && continue
    log "formatting cluster Kafka node $n storage (cluster id $cid)"
    java -Xmx256m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile="$C_DIR/log4j2-tools.properties" \
      -cp "$JAR_DIR/*" kafka.tools.StorageTool format -t "$cid" -c "$d/server.properties" \
      >"$d/logs/format.log" 2>&1 </dev/null 8>&- 9>&- &
    pids+=("$!")
    nodes+=("$n")
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      tail_log "$(ck_dir "${nodes[$i]}")/logs/format.log"
      failed=1
    fi
  done
  ((failed == 0)) || die "kafka storage format failed for a cluster node"
}

start_ck() { # node
  local n="$1" d pid p c
  d="$(ck_dir "$n")"
  p=$((CK_PORT + n - 1))
  c=$((CC_PORT + n - 1))
  pid="$(ck_pid "$n")"
  if [[ -n "$pid" ]]; then
    log "cluster Kafka node $n already running (pid $pid)"
    return 0
  fi
  rm -f "$d/kafka.pid"
  if port_open "$p" || port_open "$c"; then
    die "port $p or $c on $HOST is in use by a process that is not ours (set QBATCH_CLUSTER_KAFKA_PORT / QBATCH_CLUSTER_CONTROLLER_PORT)"
  fi
  [[ -f "$d/data/meta.properties" ]] || die "cluster Kafka node $n is not formatted (run \`up --brokers $CLUSTER_BROKERS\`)"
  log "starting cluster Kafka node $n on $HOST:$p (controller $HOST:$c)"
  # shellcheck disable=SC2086
  setsid java $CLUSTER_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent \
    -Djava.awt.headless=true \
    -Dkafka.logs.dir="$d/logs" \
    -Dlog4j2.configurationFile="$d/log4j2.properties" \
    -cp "$JAR_DIR/*" kafka.Kafka "$d/server.properties" \
    >"$d/logs/kafka.out" 2>&1 </dev/null 8>&- 9>&- &
  echo $! >"$d/kafka.pid"
}

wait_ck_port() { # node deadline(SECONDS)
  local n="$1" d p
  d="$(ck_dir "$n")"
  p=$((CK_PORT + n - 1))
  until port_open "$p"; do
    if ! pid_alive "$(read_pid "$d/kafka.pid")"; then
      tail_log "$d/logs/kafka.out"
      tail_log "$d/logs/server.log"
      die "cluster Kafka node $n exited during startup (logs: $d/logs)"
    fi
    ((SECONDS < $2)) || die "cluster Kafka node $n did not open $HOST:$p in time (logs: $d/logs)"
    sleep 0.3
  done
}

# kafka_ctl.py wait against BOOTSTRAP for at least N brokers, within the deadline
ck_metadata() { # bootstrap brokers deadline(SECONDS)
  local py left=$(($3 - SECONDS))
  ((left > 0)) || left=1
  py="$(pick_python)" || die "the cluster mode needs kafka-python (.venv, or set QBATCH_PYTHON)"
  mkdir -p "$C_DIR"
  if ! "$py" "$SCRIPT_DIR/kafka_ctl.py" wait --bootstrap "$1" --brokers "$2" --timeout "$left" \
    2>"$C_DIR/health.err" >&2; then
    cat "$C_DIR/health.err" >&2
    return 1
  fi
}

wait_cluster_kafka() {
  local deadline=$((SECONDS + CLUSTER_START_TIMEOUT)) n
  for n in $(ck_nodes); do wait_ck_port "$n" "$deadline"; done
  if ! ck_metadata "$CLUSTER_BOOTSTRAP" "$CLUSTER_BROKERS" "$deadline"; then
    for n in $(ck_nodes); do tail_log "$(ck_dir "$n")/logs/server.log" 15; done
    die "the cluster did not list $CLUSTER_BROKERS brokers on $CLUSTER_BOOTSTRAP within ${CLUSTER_START_TIMEOUT}s (logs: $C_DIR/kafka-*/logs)"
  fi
  log "cluster Kafka up: $CLUSTER_BROKERS brokers on $CLUSTER_BOOTSTRAP"
}

start_cr() { # port
  local port="$1" d pid
  d="$(cr_dir "$port")"
  pid="$(cr_pid "$port")"
  if [[ -n "$pid" ]]; then
    log "cluster Redis $port already running (pid $pid)"
    return 0
  fi
  rm -f "$d/redis.pid"
  if port_open "$port" || port_open $((port + 10000)); then
    die "port $port or its cluster bus port $((port + 10000)) on $HOST is in use by a process that is not ours (set QBATCH_CLUSTER_REDIS_PORT)"
  fi
  mkdir -p "$d"
  log "starting cluster Redis on $HOST:$port"
  # append-only (fsync every second): a master killed and restarted before its replica
  # took over comes back with its data instead of empty (and would not wipe the replica)
  if ! redis-server --bind "$HOST" --port "$port" --protected-mode yes \
    --daemonize yes --pidfile "$d/redis.pid" --logfile "$d/redis.log" --dir "$d" \
    --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout "$CR_NODE_TIMEOUT" --repl-ping-replica-period 1 \
    --save '' --appendonly yes --appendfsync everysec 8>&- 9>&-; then
    tail_log "$d/redis.log"
    die "redis-server failed to start on $port"
  fi
}

wait_cr_ping() { # port seconds
  local deadline=$((SECONDS + $2))
  while ((SECONDS < deadline)); do
    if [[ "$(cr_cli "$1" ping)" == PONG && -n "$(cr_pid "$1")" ]]; then
      return 0
    fi
    sleep 0.2
  done
  tail_log "$(cr_dir "$1")/redis.log"
  die "cluster Redis $HOST:$1 did not answer PING within $2s"
}

# "masters replicas" as node $1 sees them (failed nodes not counted)
cr_roles() {
  cr_cli "$1" cluster nodes | awk '
    $3 !~ /fail/ && $3 ~ /master/ { m++ }
    $3 !~ /fail/ && $3 ~ /slave/ { r++ }
    END { print m + 0, r + 0 }'
}

# Every node says ok, knows all 6 and reports all 6 "online" in CLUSTER SHARDS; the first
# sees 3 masters + 3 replicas. "online" matters: a replica whose replication offset is still
# 0 (no write or master PING reached it yet) shows as "loading" there and is left out of
# CLUSTER SLOTS, so a client that maps the cluster then sees no replicas (CI hit this right
# after `up`). The master PINGs its replicas every second here (repl-ping-replica-period 1,
# Redis's default is 10 s), which moves the offset off 0 without a write.
redis_cluster_ok() {
  local p
  for p in $(cr_ports); do
    [[ "$(cr_info "$p" cluster_state)" == ok ]] || return 1
    [[ "$(cr_info "$p" cluster_known_nodes)" == "$CR_NODES" ]] || return 1
    [[ "$(cr_cli "$p" cluster shards | grep -c '^online$')" == "$CR_NODES" ]] || return 1
  done
  [[ "$(cr_roles "$CR_PORT")" == "$((CR_NODES / 2)) $((CR_NODES / 2))" ]]
}

ensure_redis_cluster() {
  local p fresh=1 addrs=() deadline
  if redis_cluster_ok; then
    log "redis cluster ok ($HOST:$CR_PORT-$((CR_PORT + CR_NODES - 1)))"
    return 0
  fi
  for p in $(cr_ports); do
    if [[ "$(cr_info "$p" cluster_known_nodes)" != 1 || "$(cr_info "$p" cluster_slots_assigned)" != 0 ]]; then
      fresh=0
    fi
    addrs+=("$HOST:$p")
  done
  if ((fresh)); then
    log "creating the redis cluster: 3 masters with one replica each"
    if ! redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
      >"$C_DIR/redis-create.log" 2>&1 </dev/null; then
      tail_log "$C_DIR/redis-create.log"
      die "redis-cli --cluster create failed"
    fi
  else
    log "redis cluster nodes already joined: waiting for cluster_state:ok"
  fi
  deadline=$((SECONDS + ${QBATCH_CLUSTER_REDIS_TIMEOUT:-60}))
  until redis_cluster_ok; do
    if ((SECONDS >= deadline)); then
      cr_cli "$CR_PORT" cluster info >&2
      cr_cli "$CR_PORT" cluster nodes >&2
      die "the redis cluster is not ok (3 masters + 3 replicas) after ${QBATCH_CLUSTER_REDIS_TIMEOUT:-60}s; \`down --cluster --wipe\` starts it over"
    fi
    sleep 0.3
  done
  log "redis cluster ok: 3 masters + 3 replicas on $HOST:$CR_PORT-$((CR_PORT + CR_NODES - 1))"
}

# Stops every cluster process (SIGTERM to all at once, so the KRaft nodes shut down
# together instead of the last one waiting for a lost quorum; KILL after 30 s).
cluster_down() { # wipe(0/1)
  local n p pid pids=()
  for n in $(ck_nodes); do
    pid="$(ck_pid "$n")"
    if [[ -n "$pid" ]]; then
      log "stopping cluster Kafka node $n (pid $pid)"
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for p in $(cr_ports); do
    pid="$(cr_pid "$p")"
    if [[ -n "$pid" ]]; then
      log "stopping cluster Redis $p (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  if ((${#pids[@]})) && ! wait_gone 30 "${pids[@]}"; then
    log "cluster processes did not stop in 30s, sending KILL"
    for pid in "${pids[@]}"; do
      kill -KILL -- "-$pid" 2>/dev/null || true
      kill -KILL "$pid" 2>/dev/null || true
    done
    wait_gone 5 "${pids[@]}" || die "cluster processes ${pids[*]} are still alive"
  fi
  ((${#pids[@]})) || log "cluster not running"
  for n in $(ck_nodes); do rm -f "$(ck_dir "$n")/kafka.pid"; done
  for p in $(cr_ports); do rm -f "$(cr_dir "$p")/redis.pid"; done
  if (($1)); then
    log "wiping cluster run data $C_DIR"
    rm -rf "$C_DIR" "$CLUSTER_ENV"
  fi
}

# prints the cluster's state; 0 if every part that was set up is fully up, 3 otherwise
cluster_status() {
  local rc=0 n p pid any=0 role m_r state alive=""
  if compgen -G "$C_DIR/kafka-*" >/dev/null; then
    any=1
    for n in $(ck_nodes); do
      pid="$(ck_pid "$n")"
      if [[ -n "$pid" ]]; then
        echo "cluster-kafka node $n: running pid=$pid port=$HOST:$((CK_PORT + n - 1)) controller=$HOST:$((CC_PORT + n - 1))"
      else
        echo "cluster-kafka node $n: not running (port $HOST:$((CK_PORT + n - 1)))"
        rc=3
      fi
    done
    if ck_metadata "$CLUSTER_BOOTSTRAP" "$CLUSTER_BROKERS" $((SECONDS + 5)) >/dev/null 2>&1; then
      echo "cluster-kafka: bootstrap=$CLUSTER_BOOTSTRAP all $CLUSTER_BROKERS brokers in the metadata"
    else
      echo "cluster-kafka: bootstrap=$CLUSTER_BOOTSTRAP NOT all $CLUSTER_BROKERS brokers in the metadata"
      rc=3
    fi
  fi
  if compgen -G "$C_DIR/redis-*" >/dev/null; then
    any=1
    for p in $(cr_ports); do
      pid="$(cr_pid "$p")"
      if [[ -n "$pid" ]]; then
        role="$(cr_cli "$p" role | head -n1)"
        echo "cluster-redis $HOST:$p: running pid=$pid role=${role:-?}"
        [[ -n "$alive" ]] || alive="$p"
      else
        echo "cluster-redis $HOST:$p: not running"
        rc=3
      fi
    done
    if [[ -n "$alive" ]]; then
      state="$(cr_info "$alive" cluster_state)"
      m_r="$(cr_roles "$alive")"
      echo "cluster-redis: url=$CLUSTER_REDIS_URL cluster_state=${state:-?} masters=${m_r% *} replicas=${m_r#* } (as $HOST:$alive sees it)"
      [[ "$state" == ok && "$m_r" == "3 3" ]] || rc=3
    else
      echo "cluster-redis: url=$CLUSTER_REDIS_URL no node running"
      rc=3
    fi
  fi
  if ((!any)); then
    echo "cluster: not set up (\`up --brokers 3\` / \`up --redis-cluster\`)"
    rc=3
  fi
  echo "cluster logs: $C_DIR/kafka-N/logs/server.log  $C_DIR/redis-PORT/redis.log"
  return $rc
}

cmd_up_cluster() {
  local t0=$SECONDS n p kb="$BOOTSTRAP" ru="$REDIS_URL" env_file="$CLUSTER_ENV"
  local other_redis=$((WANT_RCLUSTER || WANT_RSENTINEL))
  ensure_tools
  cluster_lock
  if ((WANT_BROKERS == 1 || other_redis == 0)); then
    # the single-node half the exports point at (its own lock, released right after)
    lock
    mkdir -p "$K_DIR/logs" "$R_DIR"
    ((other_redis)) || start_redis
    ((WANT_BROKERS > 1)) || start_kafka
    ((other_redis)) || wait_redis
    if ((WANT_BROKERS == 1)); then
      wait_kafka
      ensure_topics || die "topic creation failed"
    fi
    exec 9>&-
  fi
  mkdir -p "$C_DIR"
  if ((WANT_BROKERS > 1)); then
    fetch_jars
    for n in $(ck_nodes); do [[ -n "$(ck_pid "$n")" ]] || write_ck_config "$n"; done
    format_cluster
    for n in $(ck_nodes); do start_ck "$n"; done
    kb="$CLUSTER_BOOTSTRAP"
  fi
  if ((WANT_RCLUSTER)); then
    for p in $(cr_ports); do start_cr "$p"; done
    for p in $(cr_ports); do wait_cr_ping "$p" "$REDIS_START_TIMEOUT"; done
    ensure_redis_cluster
    ru="$CLUSTER_REDIS_URL"
  fi
  if ((WANT_RSENTINEL)); then
    sentinel_up
    ru="$SENTINEL_REDIS_URL"
    env_file="$SENTINEL_ENV"
  fi
  if ((WANT_BROKERS > 1)); then
    wait_cluster_kafka
    ensure_topics "$CLUSTER_BOOTSTRAP" "$CLUSTER_BROKERS" || die "cluster topic creation failed"
  fi
  (umask 077 && print_env "$kb" "$ru" >"$env_file" && chmod 600 "$env_file")
  log "$( ((WANT_RSENTINEL)) && echo "sentinel set" || echo cluster) up in $((SECONDS - t0))s; settings in $env_file"
  print_env "$kb" "$ru"
}

cmd_env_cluster() {
  local kb="$BOOTSTRAP" ru="$REDIS_URL"
  ((WANT_BROKERS == 1)) || kb="$CLUSTER_BOOTSTRAP"
  ((WANT_RCLUSTER == 0)) || ru="$CLUSTER_REDIS_URL"
  ((WANT_RSENTINEL == 0)) || ru="$SENTINEL_REDIS_URL"
  print_env "$kb" "$ru"
}

cmd_kill_broker() { # node signal
  local n="$1" sig="$2" pid
  check_broker_arg "$n"
  pid="$(ck_pid "$n")"
  [[ -n "$pid" ]] || die "cluster Kafka node $n is not running"
  log "sending SIG$sig to cluster Kafka node $n (pid $pid, port $((CK_PORT + n - 1)))"
  kill "-$sig" -- "-$pid" 2>/dev/null || kill "-$sig" "$pid"
  wait_gone 60 "$pid" || die "cluster Kafka node $n (pid $pid) still alive after SIG$sig"
  log "cluster Kafka node $n is down"
}

cmd_start_broker() { # node
  local n="$1" deadline
  check_broker_arg "$n"
  ensure_tools
  cluster_lock
  mkdir -p "$C_DIR"
  fetch_jars
  [[ -n "$(ck_pid "$n")" ]] || write_ck_config "$n"
  start_ck "$n"
  deadline=$((SECONDS + CLUSTER_START_TIMEOUT))
  wait_ck_port "$n" "$deadline"
  # it answers metadata requests on its own port once it has caught up with the quorum
  ck_metadata "$HOST:$((CK_PORT + n - 1))" 1 "$deadline" ||
    die "cluster Kafka node $n did not serve metadata within ${CLUSTER_START_TIMEOUT}s"
  log "cluster Kafka node $n is up (pid $(ck_pid "$n"))"
}

cmd_kill_redis() { # port
  local p="$1" pid
  check_redis_arg "$p"
  pid="$(cr_pid "$p")"
  [[ -n "$pid" ]] || die "cluster Redis $p is not running"
  log "sending SIGKILL to cluster Redis $p (pid $pid)"
  kill -KILL "$pid"
  wait_gone 10 "$pid" || die "cluster Redis $p (pid $pid) still alive after SIGKILL"
  log "cluster Redis $p is down"
}

cmd_start_redis() { # port
  local p="$1" deadline
  check_redis_arg "$p"
  ensure_tools
  cluster_lock
  start_cr "$p"
  wait_cr_ping "$p" "$REDIS_START_TIMEOUT"
  # it rejoins from its nodes.conf; report (not fail) if the cluster is not ok yet, e.g.
  # while another master is still down
  deadline=$((SECONDS + 20))
  until [[ "$(cr_info "$p" cluster_state)" == ok ]]; do
    if ((SECONDS >= deadline)); then
      log "WARNING: cluster Redis $p is up but reports cluster_state:$(cr_info "$p" cluster_state)"
      return 0
    fi
    sleep 0.2
  done
  log "cluster Redis $p is up ($(cr_cli "$p" role | head -n1)), cluster_state ok"
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
  if ((CLUSTER_ONLY)); then
    cluster_status
    return
  fi
  if ((SENTINEL_ONLY)); then
    sentinel_status
    return
  fi
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
  # the cluster modes' processes, when set up (shown only: the exit status is the
  # single-node stack's; `status --cluster` for the cluster's)
  if [[ -d "$C_DIR" ]]; then cluster_status || true; fi
  if [[ -d "$S_DIR" ]]; then sentinel_status || true; fi
  return $ok
}

cmd_down() {
  local wipe=0 pid
  [[ "${1:-}" == --wipe ]] && wipe=1
  # the cluster modes' processes first (plain `down` stops everything; `down --cluster`
  # stops only them and leaves the single-node stack running)
  cluster_lock
  if ((SENTINEL_ONLY)); then
    sentinel_down "$wipe"
    log "sentinel set down"
    return 0
  fi
  ((CLUSTER_ONLY)) || sentinel_down "$wipe"
  cluster_down "$wipe"
  if ((CLUSTER_ONLY)); then
    log "cluster down"
    return 0
  fi
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
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2
  exit 2
}

# flags each command takes; anything else is refused (a mistyped or unsupported flag
# such as `up --brokers 5` must not silently start the default stack)
allowed_flags() {
  case "$1" in
    up) echo "--quiet -q --sasl --brokers N --redis-cluster --redis-sentinel" ;;
    env) echo "--quiet -q --sasl --brokers N --redis-cluster --redis-sentinel" ;;
    down) echo "--quiet -q --wipe --cluster --sentinel" ;;
    status) echo "--quiet -q --cluster --sentinel" ;;
    logs) echo "--quiet -q --cluster" ;;
    kill-broker | stop-broker | start-broker) echo "N (1-$CLUSTER_BROKERS) --quiet -q" ;;
    kill-redis | start-redis) echo "PORT ($CR_PORT-$((CR_PORT + CR_NODES - 1)), $SN_PORT-$((SN_PORT + SN_NODES - 1))) --quiet -q" ;;
    *) echo "--quiet -q" ;;
  esac
}

refuse() { # cmd arg
  echo "stack: ERROR: '$1' does not take '$2' (it takes:$(allowed_flags "$1" | sed 's/^/ /'))" >&2
  exit 2
}

main() {
  local cmd="${1:-}"
  shift || true
  local args=() a n
  while (($#)); do
    a="$1"
    shift
    case "$cmd:$a" in
      *:--quiet | *:-q) QUIET=1 ;;
      up:--sasl | env:--sasl) SASL=1 ;;
      up:--brokers | env:--brokers | up:--brokers=* | env:--brokers=*)
        if [[ "$a" == *=* ]]; then
          n="${a#*=}"
        else
          n="${1:-}"
          shift || true
        fi
        [[ "$n" == 1 || "$n" == "$CLUSTER_BROKERS" ]] || refuse "$cmd" "--brokers $n"
        WANT_BROKERS="$n"
        ;;
      up:--redis-cluster | env:--redis-cluster) WANT_RCLUSTER=1 ;;
      up:--redis-sentinel | env:--redis-sentinel) WANT_RSENTINEL=1 ;;
      down:--wipe) args+=("$a") ;;
      down:--cluster | status:--cluster | logs:--cluster) CLUSTER_ONLY=1 ;;
      down:--sentinel | status:--sentinel) SENTINEL_ONLY=1 ;;
      kill-broker:* | stop-broker:* | start-broker:* | kill-redis:* | start-redis:*)
        [[ -z "$TARGET" && "$a" =~ ^[0-9]+$ ]] || refuse "$cmd" "$a"
        TARGET="$a"
        ;;
      *) refuse "$cmd" "$a" ;;
    esac
  done
  if ((WANT_BROKERS > 1)) && sasl_on; then
    echo "stack: ERROR: the $CLUSTER_BROKERS-broker cluster has no SASL mode (drop --sasl / QBATCH_KAFKA_SASL)" >&2
    exit 2
  fi
  if ((WANT_RCLUSTER && WANT_RSENTINEL)); then
    echo "stack: ERROR: --redis-cluster and --redis-sentinel each give QBATCH_REDIS_URL: pick one" >&2
    exit 2
  fi
  case "$cmd" in
    kill-broker | stop-broker | start-broker | kill-redis | start-redis)
      [[ -n "$TARGET" ]] || refuse "$cmd" "(nothing)"
      ;;
  esac
  case "$cmd" in
    up)
      if ((WANT_BROKERS > 1 || WANT_RCLUSTER || WANT_RSENTINEL)); then cmd_up_cluster; else cmd_up; fi
      ;;
    status) cmd_status ;;
    down) cmd_down "${args[@]}" ;;
    reset) cmd_down --wipe ;;
    env)
      if ((WANT_BROKERS > 1 || WANT_RCLUSTER || WANT_RSENTINEL)); then cmd_env_cluster; else print_env; fi
      ;;
    kill-broker) cmd_kill_broker "$TARGET" KILL ;;
    stop-broker) cmd_kill_broker "$TARGET" TERM ;;
    start-broker) cmd_start_broker "$TARGET" ;;
    kill-redis) if is_sn_port "$TARGET"; then cmd_kill_sn "$TARGET"; else cmd_kill_redis "$TARGET"; fi ;;
    start-redis)
      if is_sn_port "$TARGET"; then
        ensure_tools
        cluster_lock
        cmd_start_sn "$TARGET"
      else
        cmd_start_redis "$TARGET"
      fi
      ;;
    fetch)
      ensure_tools
      lock
      fetch_jars
      ;;
    logs)
      if ((CLUSTER_ONLY)); then
        tail -n 30 "$C_DIR"/kafka-*/logs/server.log "$C_DIR"/redis-*/redis.log 2>/dev/null || true
      else
        tail -n 50 "$K_DIR/logs/server.log" "$R_DIR/redis.log" 2>/dev/null || true
      fi
      ;;
    -h | --help | help) usage ;;
    *) usage ;;
  esac
}

main "$@"

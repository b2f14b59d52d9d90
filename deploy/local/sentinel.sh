# Redis Sentinel mode of deploy/local/stack.sh (sourced by it; uses its HOST, RUN_DIR,
# log/die/tail_log, our_pid, port_open, cr_cli and wait_gone).
#
#   stack.sh up --redis-sentinel   one master + two replicas (127.0.0.1:16479-16481) and
#                                  three sentinels (26479-26481) watching service `qbatch`
#                                  (quorum 2, down-after 1000 ms, failover-timeout 5000 ms);
#                                  the exports carry a redis+sentinel:// URL
#   stack.sh kill-redis PORT | start-redis PORT   SIGKILL / start again a data node; a
#                                  node started while the sentinels name another master
#                                  comes back as its replica
#   stack.sh status --sentinel     these six only; exit 0 if the master has both replicas
#                                  and every sentinel sees it, the two others and both
#                                  replicas with their links ok (sentinel_state)
#   stack.sh down --sentinel [--wipe]   stop (wipe) these six only
#
# Data nodes are append-only (fsync every second), as on the cluster: a master killed and
# restarted before the failover comes back with its data instead of empty (an empty
# master would wipe its replica). `redis-server --sentinel` is the sentinel: Debian's
# redis-server package has no separate redis-sentinel binary to depend on.
#
# Data nodes run with `min-replicas-to-write 2` (both replicas; `min-replicas-max-lag 10`):
# a master missing a replica refuses writes (NOREPLICAS, an outage for qbatch) instead of
# taking writes a failover then drops. Measured here with a write every 2 ms through a
# `SENTINEL FAILOVER`: the old master, still a master for ~11 s after its replica was
# promoted, took and lost 3,298 of 3,773 acknowledged writes with the setting off, 393
# with `min-replicas-to-write 1` (until the second replica was moved to the new master),
# none with 2 (writes waited ~11 s instead). The price: any node down stops writes until
# it is back (QBATCH_SENTINEL_MIN_REPLICAS=0 or 1 trades that back).

SN_PORT="${QBATCH_SENTINEL_REDIS_PORT:-16479}"      # first master; replicas on SN_PORT + 1, + 2
SN_NODES=3
SN_MIN_REPLICAS="${QBATCH_SENTINEL_MIN_REPLICAS:-2}" # min-replicas-to-write (0: off)
SS_PORT="${QBATCH_SENTINEL_PORT:-26479}"            # sentinels SS_PORT .. SS_PORT + 2
SN_SERVICE="${QBATCH_SENTINEL_SERVICE:-qbatch}"
SN_DOWN_AFTER="${QBATCH_SENTINEL_DOWN_AFTER_MS:-1000}" # ms a master is silent before failover
SN_FAILOVER_TIMEOUT="${QBATCH_SENTINEL_FAILOVER_TIMEOUT_MS:-5000}"
SN_TIMEOUT="${QBATCH_SENTINEL_TIMEOUT:-60}"         # s until the set is ok
S_DIR="$RUN_DIR/sentinel"
SENTINEL_ENV="$RUN_DIR/sentinel-env.sh"
SENTINEL_REDIS_URL="redis+sentinel://$HOST:$SS_PORT,$HOST:$((SS_PORT + 1)),$HOST:$((SS_PORT + 2))/$SN_SERVICE"

sn_ports() { seq "$SN_PORT" $((SN_PORT + SN_NODES - 1)); }
ss_ports() { seq "$SS_PORT" $((SS_PORT + 2)); }
sn_dir() { echo "$S_DIR/redis-$1"; }
ss_dir() { echo "$S_DIR/sentinel-$1"; }
sn_pid() { our_pid "$(sn_dir "$1")/redis.pid" "redis-server $HOST:$1"; }
ss_pid() { our_pid "$(ss_dir "$1")/sentinel.pid" "redis-server $HOST:$1"; }
is_sn_port() { [[ "$1" =~ ^[0-9]+$ ]] && (($1 >= SN_PORT && $1 < SN_PORT + SN_NODES)); }

# the port of the master the sentinels name now: a running sentinel's answer, else the
# last one a sentinel wrote into its config, else SN_PORT
sn_master_port() {
  local p port
  for p in $(ss_ports); do
    [[ -n "$(ss_pid "$p")" ]] || continue
    port="$(cr_cli "$p" sentinel get-master-addr-by-name "$SN_SERVICE" | sed -n 2p)"
    if [[ "$port" =~ ^[0-9]+$ ]]; then
      echo "$port"
      return 0
    fi
  done
  for p in $(ss_ports); do
    port="$(awk -v s="$SN_SERVICE" '$1 == "sentinel" && $2 == "monitor" && $3 == s { print $5 }' \
      "$(ss_dir "$p")/sentinel.conf" 2>/dev/null | tail -n1)"
    if [[ "$port" =~ ^[0-9]+$ ]]; then
      echo "$port"
      return 0
    fi
  done
  echo "$SN_PORT"
}

# 0 when `port` is free to start on; 1 when our process already runs there (logged); dies
# when a process that is not ours holds the port.
sentinel_claim() { # what port pid pidfile env-var
  local what="$1" port="$2" pid="$3" pidfile="$4" var="$5"
  if [[ -n "$pid" ]]; then
    log "$what $port already running (pid $pid)"
    return 1
  fi
  rm -f "$pidfile"
  if port_open "$port"; then
    die "port $port on $HOST is in use by a process that is not ours (set $var)"
  fi
  return 0
}

start_sn() { # port master-port
  local port="$1" master="$2" d role=()
  d="$(sn_dir "$port")"
  sentinel_claim "sentinel-mode Redis" "$port" "$(sn_pid "$port")" "$d/redis.pid" \
    QBATCH_SENTINEL_REDIS_PORT || return 0
  mkdir -p "$d"
  ((port == master)) || role=(--replicaof "$HOST" "$master")
  log "starting sentinel-mode Redis on $HOST:$port (${role[*]:-master})"
  if ! redis-server --bind "$HOST" --port "$port" --protected-mode yes \
    --daemonize yes --pidfile "$d/redis.pid" --logfile "$d/redis.log" --dir "$d" \
    --save '' --appendonly yes --appendfsync everysec \
    --min-replicas-to-write "$SN_MIN_REPLICAS" --min-replicas-max-lag 10 \
    "${role[@]}" 7>&- 8>&- 9>&-; then
    tail_log "$d/redis.log"
    die "redis-server failed to start on $port"
  fi
}

start_ss() { # port master-port
  local port="$1" master="$2" d
  d="$(ss_dir "$port")"
  sentinel_claim sentinel "$port" "$(ss_pid "$port")" "$d/sentinel.pid" QBATCH_SENTINEL_PORT \
    || return 0
  mkdir -p "$d"
  # written once: the sentinel rewrites it (its id, the current master, the peers it met),
  # and a restart with a fresh id would leave a ghost peer in the others' quorum counts
  if [[ ! -s "$d/sentinel.conf" ]]; then
    cat >"$d/sentinel.conf" <<EOF
# generated by deploy/local/stack.sh up --redis-sentinel; the sentinel rewrites it
port $port
bind $HOST
protected-mode yes
daemonize yes
pidfile $d/sentinel.pid
logfile $d/sentinel.log
dir $d
sentinel monitor $SN_SERVICE $HOST $master 2
sentinel down-after-milliseconds $SN_SERVICE $SN_DOWN_AFTER
sentinel failover-timeout $SN_SERVICE $SN_FAILOVER_TIMEOUT
sentinel parallel-syncs $SN_SERVICE 1
EOF
  fi
  log "starting sentinel on $HOST:$port"
  if ! redis-server "$d/sentinel.conf" --sentinel 7>&- 8>&- 9>&-; then
    tail_log "$d/sentinel.log"
    die "redis-server --sentinel failed to start on $port"
  fi
}

# sentinel_state: "ok" once every sentinel names the same master (flags exactly `master`:
# no failover under way), knows the 2 other sentinels, and sees all SN_NODES - 1 replicas
# of that master with flags `slave` and master-link-status ok, and the master has them
# connected; else what is not so yet. A set where a sentinel still sees a replica's link
# as `err` (its view lags the replica's own) would abort a switchover sent now
# (-failover-abort-slave-timeout), so `up` and `status` wait for the sentinels' view too.
sentinel_state() {
  local p m="" mine info flags others good link
  for p in $(ss_ports); do
    info="$(cr_cli "$p" sentinel master "$SN_SERVICE" | paste - -)"
    [[ -n "$info" ]] || { echo "sentinel $p does not answer"; return 0; }
    mine="$(awk '$1 == "port" { print $2 }' <<<"$info")"
    flags="$(awk '$1 == "flags" { print $2 }' <<<"$info")"
    others="$(awk '$1 == "num-other-sentinels" { print $2 }' <<<"$info")"
    [[ -z "$m" || "$m" == "$mine" ]] || { echo "sentinels disagree: $m / $mine"; return 0; }
    m="$mine"
    [[ "$flags" == master ]] || { echo "sentinel $p: master $m flags=$flags"; return 0; }
    [[ "$others" == 2 ]] || { echo "sentinel $p knows $others other sentinels"; return 0; }
    # SENTINEL REPLICAS: one flat field/value list per replica, each starting at `name`
    good="$(cr_cli "$p" sentinel replicas "$SN_SERVICE" | paste - - | awk -v m="$m" '
      function done_one() { if (seen && f == "slave" && l == "ok" && mp == m) n++ }
      $1 == "name" { done_one(); seen = 1; f = l = mp = "" }
      $1 == "flags" { f = $2 }
      $1 == "master-link-status" { l = $2 }
      $1 == "master-port" { mp = $2 }
      END { done_one(); print n + 0 }')"
    ((good == SN_NODES - 1)) || { echo "sentinel $p sees $good of $((SN_NODES - 1)) replicas in order"; return 0; }
  done
  [[ "$(cr_cli "$m" info replication | sed -n 's/^connected_slaves://p')" -ge $((SN_NODES - 1)) ]] 2>/dev/null ||
    { echo "master $m lacks a connected replica"; return 0; }
  for p in $(sn_ports); do
    ((p == m)) && continue
    link="$(cr_cli "$p" info replication | sed -n 's/^master_link_status://p')"
    [[ "$link" == up ]] || { echo "replica $p link=${link:-down}"; return 0; }
  done
  echo ok
}

wait_sentinel_ok() {
  local deadline=$((SECONDS + SN_TIMEOUT)) state
  while true; do
    state="$(sentinel_state)"
    [[ "$state" == ok ]] && break
    if ((SECONDS >= deadline)); then
      tail_log "$(ss_dir "$SS_PORT")/sentinel.log" 20
      die "the sentinel set is not ok after ${SN_TIMEOUT}s: $state (\`down --sentinel --wipe\` starts it over)"
    fi
    sleep 0.3
  done
  log "sentinel set ok: master $HOST:$(sn_master_port), $((SN_NODES - 1)) replicas, 3 sentinels on $HOST:$SS_PORT-$((SS_PORT + 2))"
}

sentinel_up() {
  local p master
  mkdir -p "$S_DIR"
  master="$(sn_master_port)"
  for p in $(sn_ports); do start_sn "$p" "$master"; done
  for p in $(ss_ports); do start_ss "$p" "$master"; done
  wait_sentinel_ok
}

sentinel_down() { # wipe(0/1)
  local p pid pids=()
  for p in $(ss_ports); do
    pid="$(ss_pid "$p")"
    [[ -z "$pid" ]] || { log "stopping sentinel $p (pid $pid)"; kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); }
  done
  for p in $(sn_ports); do
    pid="$(sn_pid "$p")"
    [[ -z "$pid" ]] || { log "stopping sentinel-mode Redis $p (pid $pid)"; kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); }
  done
  if ((${#pids[@]})) && ! wait_gone 30 "${pids[@]}"; then
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    wait_gone 5 "${pids[@]}" || die "sentinel-mode processes ${pids[*]} are still alive"
  fi
  for p in $(sn_ports); do rm -f "$(sn_dir "$p")/redis.pid"; done
  for p in $(ss_ports); do rm -f "$(ss_dir "$p")/sentinel.pid"; done
  if (($1)); then
    log "wiping sentinel run data $S_DIR"
    rm -rf "$S_DIR" "$SENTINEL_ENV"
  fi
}

sentinel_status() {
  local rc=0 p pid state
  for p in $(sn_ports); do
    pid="$(sn_pid "$p")"
    if [[ -n "$pid" ]]; then
      echo "sentinel-redis $HOST:$p: running pid=$pid role=$(cr_cli "$p" role | head -n1)"
    else
      echo "sentinel-redis $HOST:$p: not running"
      rc=3
    fi
  done
  for p in $(ss_ports); do
    pid="$(ss_pid "$p")"
    if [[ -n "$pid" ]]; then echo "sentinel $HOST:$p: running pid=$pid"; else
      echo "sentinel $HOST:$p: not running"
      rc=3
    fi
  done
  state="$(sentinel_state)"
  echo "sentinel-set: url=$SENTINEL_REDIS_URL master=$HOST:$(sn_master_port) state=$state"
  [[ "$state" == ok ]] || rc=3
  return $rc
}

cmd_kill_sn() { # port
  local p="$1" pid
  pid="$(sn_pid "$p")"
  [[ -n "$pid" ]] || die "sentinel-mode Redis $p is not running"
  log "sending SIGKILL to sentinel-mode Redis $p (pid $pid)"
  kill -KILL "$pid"
  wait_gone 10 "$pid" || die "sentinel-mode Redis $p (pid $pid) still alive after SIGKILL"
  log "sentinel-mode Redis $p is down"
}

cmd_start_sn() { # port: as the replica of the master the sentinels name (unless it is it)
  local p="$1" master deadline
  master="$(sn_master_port)"
  start_sn "$p" "$master"
  deadline=$((SECONDS + 20))
  until [[ "$(cr_cli "$p" ping)" == PONG && -n "$(sn_pid "$p")" ]]; do
    ((SECONDS < deadline)) || die "sentinel-mode Redis $p did not answer PING within 20s"
    sleep 0.2
  done
  log "sentinel-mode Redis $p is up ($(cr_cli "$p" role | head -n1); the sentinels name $master)"
}

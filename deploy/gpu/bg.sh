#!/usr/bin/env bash
# bg.sh - run THERE: a phase longer than one device call (600 s at most) as a detached
# job that outlives the call, and calls that wait for it. The machine stays lent while
# calls follow each other (it goes back ~30 s after the last one ends), so send the next
# `wait` as soon as one returns. Inside run.sh set QBATCH_KEEP_STACK=1, or the call's end
# stops Kafka and valkey under the job.
#
#   bash deploy/gpu/bg.sh start NAME 'command'   # detached (own process group), inherits the environment
#   bash deploy/gpu/bg.sh wait NAME SECONDS      # until it ends or SECONDS pass
#   bash deploy/gpu/bg.sh status NAME            # running / exited N / killed / unknown
#   bash deploy/gpu/bg.sh stop NAME              # SIGTERM to the whole group, SIGKILL after 20 s
#
# The job's output goes to $QBATCH_BG_DIR/NAME.log (default /tmp/qbatch-bg), its exit
# status to NAME.rc when it ends. The job is its process group: it counts as running while
# any process of the group lives (an engine's child outliving its parent included), so a
# second `start` never puts a second engine next to an orphan.
# `wait` prints the log's last lines and a last line `bg.sh: NAME <state>`, and exits
#   0 the job exited 0 | 1 it exited non-zero or was killed (the line says which)
#   75 it still runs   | 2 usage, or no such job
set -uo pipefail

DIR=${QBATCH_BG_DIR:-/tmp/qbatch-bg}
usage() {
  echo "usage: bg.sh start NAME 'command' | wait NAME SECONDS | status NAME | stop NAME" >&2
  exit 2
}
(($# >= 2)) || usage
action=$1 name=$2
[[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || {
  echo "bg.sh: NAME must be [A-Za-z0-9_.-]+" >&2
  exit 2
}
log="$DIR/$name.log" rcf="$DIR/$name.rc" pidf="$DIR/$name.pid"

group_alive() { [[ -f "$pidf" ]] && kill -0 -- "-$(cat "$pidf")" 2>/dev/null; }

state() {
  if group_alive; then
    echo running
  elif [[ -s "$rcf" ]]; then
    echo "exited $(cat "$rcf")"
  elif [[ -f "$pidf" ]]; then
    echo killed # ended without writing its status
  else
    echo unknown
  fi
}

case $action in
  start)
    (($# == 3)) || usage
    mkdir -p "$DIR"
    [[ "$(state)" == running ]] && {
      echo "bg.sh: $name is already running" >&2
      exit 2
    }
    rm -f "$rcf" "$pidf"
    # setsid: the job leads its own process group (its pid is the group id). The status
    # is written by the job's own shell, atomically (a reader never sees a half-written
    # file), so a job killed with the machine leaves none and `status` says "killed".
    # shellcheck disable=SC2016 # $1 and $2 are the inner shell's
    setsid nohup bash -c 'bash -c "$1"; echo $? >"$2.tmp" && mv "$2.tmp" "$2"' bg "$3" "$rcf" \
      >"$log" 2>&1 </dev/null &
    echo $! >"$pidf"
    echo "bg.sh: $name started (pid $!), log $log"
    ;;
  wait)
    (($# == 3)) && [[ "$3" =~ ^[0-9]+$ ]] || usage
    [[ "$(state)" == unknown ]] && {
      echo "bg.sh: no job $name" >&2
      exit 2
    }
    until=$((SECONDS + 10#$3))
    while [[ "$(state)" == running ]] && ((SECONDS < until)); do
      sleep 2
    done
    tail -n 20 "$log" 2>/dev/null
    s=$(state)
    echo "bg.sh: $name $s"
    case $s in
      running) exit 75 ;;
      "exited 0") exit 0 ;;
      *) exit 1 ;;
    esac
    ;;
  status)
    state
    ;;
  stop)
    group_alive || {
      echo "bg.sh: $name is not running ($(state))"
      exit 0
    }
    pgid=$(cat "$pidf")
    kill -TERM -- "-$pgid" 2>/dev/null
    for _ in $(seq 20); do
      group_alive || break
      sleep 1
    done
    group_alive && kill -KILL -- "-$pgid" 2>/dev/null
    echo "bg.sh: $name stopped ($(state))"
    ;;
  *) usage ;;
esac

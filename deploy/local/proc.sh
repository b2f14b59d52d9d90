# Process helpers shared by deploy/local/stack.sh and deploy/gpu/stack-gpu.sh (sourced).
# A stack only ever signals what its own pid files name, and only after checking that
# the process there still runs the command it started.

pid_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

read_pid() { [[ -s "$1" ]] && tr -dc '0-9' <"$1" || true; }

# port_open PORT: something listens on $HOST:PORT
port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# our_pid PIDFILE PATTERN: the pid in PIDFILE if that process is alive and its command
# line contains PATTERN, else nothing
our_pid() {
  local pid
  pid="$(read_pid "$1")"
  if pid_alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"; then
    echo "$pid"
  fi
}

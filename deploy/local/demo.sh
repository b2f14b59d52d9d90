#!/usr/bin/env bash
# The README's main job: install (first run only), bring up the local stack, run a CPU
# worker on a small Qwen3, send sample requests and print the results.
#   QBATCH_DEMO_MODEL=path-or-hub-id   use that model
#   QBATCH_DEMO_OFFLINE=1              skip the hub: tiny random-weight Qwen3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c "import torch, worker" 2>/dev/null; then
  echo "== installing qbatch with the CPU engine into .venv (first run; torch is large)" >&2
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[cpu]'  # the worker with the CPU engine (torch)
fi
exec .venv/bin/python deploy/local/demo.py "$@"

#!/usr/bin/env bash
# install-runbatch.sh - run THERE (GPU machine, no network): install the run-batch wheels of
# deploy/gpu/stage-runbatch.sh into SITE, next to the vLLM kit and the stack kit.
#
# Usage: bash deploy/gpu/install-runbatch.sh [TAR]
#   TAR default: <repo>/.gpu/runbatch.tar (carried with the call), else $QBATCH_STAGE/runbatch.tar
#   env: PYTHON (python3), SITE (/tmp/site), QBATCH_STAGE (/root/stage),
#        QBATCH_RUNBATCH_CHECK (1: import vllm.entrypoints.openai.run_batch afterwards, when
#        vllm is in SITE; ~20 s, but a missing module shows here and not in a benchmark),
#        QBATCH_RUNBATCH_PURE_ONLY=1 (only the py3-none-any wheels: a try on a Python that is
#        not 3.12, where blake3 / watchfiles would not install)
#
# 1. untar into a temp dir, check SHA256SUMS;
# 2. pip install --no-index --no-deps --target a fresh dir, moved into SITE item by item
#    (SITE/bin merged, not replaced: pip --target --upgrade would drop the vLLM kit's scripts);
# 3. the import check. A second run with the same tar is a no-op.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
PY=${PYTHON:-python3}
# shellcheck source=deploy/gpu/site-lib.sh
source "$SCRIPT_DIR/site-lib.sh"
SITE=${SITE:-/tmp/site}
STAGE=${QBATCH_STAGE:-/root/stage}

log() { echo "install-runbatch: $*" >&2; }
die() {
  echo "install-runbatch: ERROR: $*" >&2
  exit 1
}

TAR=${1:-}
if [[ -z "$TAR" ]]; then
  for f in "$REPO_ROOT/.gpu/runbatch.tar" "$STAGE/runbatch.tar"; do
    [[ -f "$f" ]] && TAR="$f" && break
  done
fi
[[ -n "$TAR" && -f "$TAR" ]] || die "no runbatch.tar (carry .gpu/runbatch.tar; stage it with deploy/gpu/stage-runbatch.sh)"

stamp="$(sha256sum "$TAR" | cut -c1-64) site=$SITE py=$PY pure=${QBATCH_RUNBATCH_PURE_ONLY:-0}"
if [[ -f "$SITE/.qbatch-runbatch" && "$(cat "$SITE/.qbatch-runbatch")" == "$stamp" ]]; then
  log "already installed in $SITE"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xf "$TAR" -C "$work"
kit="$work/qbatch-runbatch"
(cd "$kit" && sha256sum --quiet -c SHA256SUMS) || die "checksums do not match: $TAR is damaged"
shopt -s nullglob
whls=()
for w in "$kit"/wheels/*.whl; do
  if [[ "${QBATCH_RUNBATCH_PURE_ONLY:-0}" == 1 && "$w" != *-none-any.whl ]]; then
    log "skipping $(basename "$w") (QBATCH_RUNBATCH_PURE_ONLY=1)"
    continue
  fi
  whls+=("$w")
done
((${#whls[@]})) || die "no wheels in $TAR"

merge_wheels_into_site "$PY" "$SITE" runbatch "${whls[@]}" || die "pip install of the run-batch wheels failed"
log "installed ${#whls[@]} wheels into $SITE: $(for w in "${whls[@]}"; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"

if [[ "${QBATCH_RUNBATCH_CHECK:-1}" == 1 && -f "$SITE/vllm/__init__.py" ]]; then
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 "$PY" -c '
import blake3, compressed_tensors, uvicorn, watchfiles, model_hosting_container_standards
import vllm.entrypoints.openai.run_batch
from vllm.tool_parsers import ToolParserManager
ToolParserManager.get_tool_parser("hermes")
print("install-runbatch: vllm.entrypoints.openai.run_batch and the hermes tool parser import")
' >&2 || die "run_batch does not import from $SITE (a module missing from the kit? see above)"
fi
echo "$stamp" >"$SITE/.qbatch-runbatch"

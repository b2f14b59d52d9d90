#!/usr/bin/env bash
# stage-runbatch.sh - run HERE (network): the wheels `vllm run-batch` needs on the lent GPU
# machine beyond the vLLM kit (shared/gpu/stage-vllm.sh) and the stack kit (stage.sh),
# packed into one small tar, .gpu/runbatch.tar (~2 MiB: it rides along in any call's carry).
#
# Usage: bash deploy/gpu/stage-runbatch.sh
#   env: PYTHON (default python3), QBATCH_GPU_DIR (default <repo>/.gpu)
#
# Why these seven (vLLM 0.24.0, CPython 3.12): `python -m vllm.entrypoints.openai.run_batch`
# imports vllm.entrypoints.openai.api_server, which imports
#   - vllm.entrypoints.launcher               -> uvicorn
#   - vllm.entrypoints.serve.sagemaker.api_router -> model_hosting_container_standards
#                                                   (-> jmespath)
#   - vllm.entrypoints.serve.utils.ssl        -> watchfiles
# and at run time the engine imports compressed_tensors (-> loguru; vllm pins 0.17.0) for
# the quantization registry and blake3 for prefix-cache hashing. The vLLM kit leaves all
# of them out (shared/gpu/README.md: "Left out on purpose: the OpenAI server (uvicorn
# etc.) ... compressed-tensors"); uvicorn's click is in the stack kit, its h11 and
# watchfiles' anyio are in the image. The set is the one that ran 1,500 chat lines on the
# H200 on 2026-12-03 (shared/gpu/README.md, "Extra wheels").
#
# Tar members (under qbatch-runbatch/): wheels/*.whl, SHA256SUMS, MANIFEST (each wheel
# with its Requires-Dist, for the record). Idempotent; the tar is byte-for-byte
# reproducible. Installed there by deploy/gpu/install-runbatch.sh (run.sh calls it when
# .gpu/runbatch.tar travels with the call).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
PY=${PYTHON:-python3}
GPU_DIR=${QBATCH_GPU_DIR:-$REPO_ROOT/.gpu}
WHEELS="$GPU_DIR/runbatch/wheels"
TAR="$GPU_DIR/runbatch.tar"

PINS=(
  uvicorn==0.54.0
  watchfiles==1.3.0
  model-hosting-container-standards==0.1.16
  jmespath==1.1.0
  compressed-tensors==0.17.0
  loguru==0.7.3
  blake3==1.0.11
)

log() { echo "stage-runbatch: $*" >&2; }

mkdir -p "$WHEELS"
if git -C "$REPO_ROOT" rev-parse --git-dir >/dev/null 2>&1 \
  && ! git -C "$REPO_ROOT" check-ignore -q "$TAR" 2>/dev/null; then
  log "WARNING: $GPU_DIR is not git-ignored: add '/.gpu/' to .gitignore or .git/info/exclude"
fi

log "downloading ${#PINS[@]} wheels into ${WHEELS#"$REPO_ROOT"/}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d "$WHEELS" "${PINS[@]}" >&2

"$PY" - "$WHEELS" "$TAR" "${PINS[@]}" <<'PYEOF'
import hashlib, io, os, re, sys, tarfile, zipfile

wheels, tar_path, *pins = sys.argv[1:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
chosen = {}
for f in sorted(os.listdir(wheels)):
    if not f.endswith(".whl"):
        continue
    name, ver = f.split("-")[:2]
    if want.get(norm(name)) == ver and norm(name) not in chosen:
        chosen[norm(name)] = f
    else:
        print(f"stage-runbatch: removing stale {f}", file=sys.stderr)
        os.remove(os.path.join(wheels, f))
missing = sorted(set(want) - set(chosen))
if missing:
    sys.exit(f"stage-runbatch: ERROR: no wheel for {missing}")

def requires(path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("Requires-Dist:")
            and "extra ==" not in l]

def sha(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()

files = sorted(chosen.values())
manifest = "".join(
    f"wheel={f}\n" + "".join(f"  requires {r}\n" for r in requires(os.path.join(wheels, f)))
    for f in files
).encode()
sums = "".join(f"{sha(os.path.join(wheels, f))}  wheels/{f}\n" for f in files)
sums += f"{hashlib.sha256(manifest).hexdigest()}  MANIFEST\n"

def add_bytes(t, name, data):
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), 0o644, 1764633600
    t.addfile(ti, io.BytesIO(data))

with tarfile.open(tar_path + ".tmp", "w", format=tarfile.GNU_FORMAT) as t:
    add_bytes(t, "qbatch-runbatch/SHA256SUMS", sums.encode())
    add_bytes(t, "qbatch-runbatch/MANIFEST", manifest)
    for f in files:
        with open(os.path.join(wheels, f), "rb") as fh:
            add_bytes(t, f"qbatch-runbatch/wheels/{f}", fh.read())
os.replace(tar_path + ".tmp", tar_path)
size = os.path.getsize(tar_path)
print(manifest.decode(), end="", file=sys.stderr)
print(f"{tar_path}\t{size}\t{size / 2**20:.2f} MiB\t{len(files)} wheels")
PYEOF

echo
echo "carry it in the call that installs (run.sh installs it when it is there):"
echo '  run(command="... bash deploy/gpu/run.sh '"'"'<command>'"'"'", carry=[..., ".gpu/runbatch.tar"])'

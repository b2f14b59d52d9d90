#!/usr/bin/env bash
# stage.sh - run HERE (network): build the offline Kafka + Redis + Python-deps kit for the
# lent GPU machine, as .gpu/stack-NN.tar (each <= 54 MiB, BUNDLE_MIB), next to vLLM's own
# kit (.gpu/bundle-NN.tar from shared/gpu/stage-vllm.sh).
#
# Usage: bash deploy/gpu/stage.sh
#   env: PYTHON (default python3), BUNDLE_MIB (default 54), QBATCH_GPU_DIR (default <repo>/.gpu),
#        QBATCH_KAFKA_VERSION (default 4.1.2)
#
# Each tar holds members under qbatch-stack/:
#   SHA256SUMS          (in every tar; covers all files of all tars)
#   wheels/*.whl        deploy/gpu/requirements-gpu.txt (cp312 manylinux or py3-none-any)
#   jars/*.jar          Kafka's runtime jars (deploy/local/.cache/jars/kafka-VERSION)
#   install-vllm.sh     a copy of vLLM's installer (fallback when .gpu/install-vllm.sh is not carried)
#   MANIFEST            what was staged
# Idempotent: wheels already downloaded are reused, stale ones removed, tars rewritten.
# Prints the tar sizes and the `carry` list of every device call. See deploy/gpu/README.md.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
PY=${PYTHON:-python3}
LIMIT_MIB=${BUNDLE_MIB:-54}
KAFKA_VERSION=${QBATCH_KAFKA_VERSION:-4.1.2}
GPU_DIR=${QBATCH_GPU_DIR:-$REPO_ROOT/.gpu}
WORK="$GPU_DIR/stack"
WHEELS="$WORK/wheels"
REQ="$SCRIPT_DIR/requirements-gpu.txt"
JAR_SRC="$REPO_ROOT/deploy/local/.cache/jars/kafka-$KAFKA_VERSION"

log() { echo "stage: $*" >&2; }
die() {
  echo "stage: ERROR: $*" >&2
  exit 1
}

cd "$REPO_ROOT"
[[ -f "$REQ" ]] || die "$REQ missing"
mkdir -p "$WHEELS"
if git -C "$REPO_ROOT" rev-parse --git-dir >/dev/null 2>&1 \
  && ! git -C "$REPO_ROOT" check-ignore -q "$GPU_DIR/stack-01.tar" 2>/dev/null; then
  log "WARNING: $GPU_DIR is not git-ignored: add '/.gpu/' to .gitignore or .git/info/exclude"
fi

# -- 1. requirements sanity: pinned, and nothing the vLLM kit already brings
bad="$(grep -vE '^\s*(#|$)' "$REQ" | grep -vE '^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9._+-]+\s*$' || true)"
[[ -z "$bad" ]] || die "unpinned lines in $REQ: $bad"
if grep -iqE '^(pydantic|pydantic[-_]core|typing[-_]extensions|annotated[-_]types|typing[-_]inspection|annotated[-_]doc)==' "$REQ"; then
  die "$REQ lists a package the vLLM kit already brings (pydantic, pydantic-core, typing-extensions, ...)"
fi

# -- 2. wheels (pip reuses files already in $WHEELS)
log "downloading wheels listed in ${REQ#"$REPO_ROOT"/} into ${WHEELS#"$REPO_ROOT"/}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d "$WHEELS" -r "$REQ" >&2

# -- 3. Kafka jars from the local stack's cache
if [[ ! -f "$JAR_SRC/.complete" ]]; then
  log "Kafka $KAFKA_VERSION jars not cached: running deploy/local/stack.sh fetch"
  QBATCH_KAFKA_VERSION="$KAFKA_VERSION" bash "$REPO_ROOT/deploy/local/stack.sh" fetch
fi
[[ -f "$JAR_SRC/kafka_2.13-$KAFKA_VERSION.jar" ]] || die "no kafka_2.13-$KAFKA_VERSION.jar in $JAR_SRC"

# -- 4. vLLM installer copy (optional)
VLLM_INSTALLER=""
for f in "$GPU_DIR/install-vllm.sh" "$REPO_ROOT/../shared/gpu/install-vllm.sh"; do
  if [[ -f "$f" ]]; then
    VLLM_INSTALLER="$f"
    break
  fi
done

# -- 5. pack (python: match wheels to pins, checksums, balanced tars)
"$PY" - "$REQ" "$WHEELS" "$JAR_SRC" "$GPU_DIR" "$((LIMIT_MIB * 1024 * 1024))" "$KAFKA_VERSION" \
  "$VLLM_INSTALLER" <<'PYEOF'
import hashlib, io, os, re, sys, tarfile, time

req, wheels, jar_src, out, limit, kafka_version, vllm_installer = sys.argv[1:8]
limit = int(limit)
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()

pins = {}
for line in open(req):
    line = line.split("#", 1)[0].strip()
    if line:
        name, ver = line.split("==")
        pins[norm(name)] = ver.strip()

chosen, stale = {}, []
for f in sorted(os.listdir(wheels)):
    if not f.endswith(".whl"):
        continue
    name, ver = f.split("-")[:2]
    if pins.get(norm(name)) == ver and norm(name) not in chosen:
        chosen[norm(name)] = f
    else:
        stale.append(f)
for f in stale:
    print(f"stage: removing stale {f}", file=sys.stderr)
    os.remove(os.path.join(wheels, f))
missing = sorted(set(pins) - set(chosen))
if missing:
    sys.exit(f"stage: ERROR: no wheel for {missing}")
for f in chosen.values():
    tags = f[:-4].split("-")[2:]
    py, abi, plat = tags[-3:]
    pys = py.split(".")
    # py3 and py3N (N <= 12: pip offers py37 ... py312 to a 3.12 interpreter), cp312,
    # and the abi3 wheels' cp38 / cp39.
    py3n = [x for x in pys if re.fullmatch(r"py3\d*", x)]
    if not (any(int(x[3:] or 0) <= 12 for x in py3n) or {"cp312", "cp38", "cp39"} & set(pys)) or not (
        plat == "any" or "x86_64" in plat
    ):
        sys.exit(f"stage: ERROR: {f} is not for CPython 3.12 linux x86_64")

members = {}  # arcname (under qbatch-stack/) -> source path
for f in chosen.values():
    members[f"wheels/{f}"] = os.path.join(wheels, f)
jars = sorted(j for j in os.listdir(jar_src) if j.endswith(".jar"))
for j in jars:
    members[f"jars/{j}"] = os.path.join(jar_src, j)
if vllm_installer:
    members["install-vllm.sh"] = vllm_installer

manifest = (
    f"kafka_version={kafka_version}\njars={len(jars)}\nwheels={len(chosen)}\n"
    + "".join(f"wheel={w}\n" for w in sorted(chosen.values()))
).encode()

def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for b in iter(lambda: fh.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()

sums = "".join(f"{sha(p)}  {a}\n" for a, p in sorted(members.items()))
sums += f"{hashlib.sha256(manifest).hexdigest()}  MANIFEST\n"
sums = sums.encode()

cost = lambda size: 512 + (size + 511) // 512 * 512
fixed = 20 * 1024 + cost(len(sums)) + cost(len(manifest)) + 3 * 512  # + dirs
items = sorted(((cost(os.path.getsize(p)), a) for a, p in members.items()), reverse=True)
total = sum(c for c, _ in items)
n = max(1, -(-total // (limit - fixed)))
while True:  # largest first into the emptiest tar: balanced tars, room for the repo tree
    bins = [[fixed, []] for _ in range(n)]
    for c, a in items:
        b = min(bins, key=lambda b: b[0])
        b[0] += c
        b[1].append(a)
    if all(b[0] <= limit for b in bins):
        break
    n += 1

def add_bytes(t, name, data, mode=0o644):
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), mode, 1764633600  # fixed: reproducible tars
    t.addfile(ti, io.BytesIO(data))

for old in os.listdir(out):
    if re.fullmatch(r"stack-\d\d\.tar(\.tmp)?", old):
        os.remove(os.path.join(out, old))
for i, (_, names) in enumerate(bins, 1):
    path = os.path.join(out, f"stack-{i:02d}.tar")
    with tarfile.open(path + ".tmp", "w", format=tarfile.GNU_FORMAT) as t:
        add_bytes(t, "qbatch-stack/SHA256SUMS", sums)
        add_bytes(t, "qbatch-stack/MANIFEST", manifest)
        for a in sorted(names):
            ti = t.gettarinfo(members[a], arcname=f"qbatch-stack/{a}")
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 1764633600
            ti.mode = 0o755 if a.endswith(".sh") else 0o644
            with open(members[a], "rb") as fh:
                t.addfile(ti, fh)
    os.replace(path + ".tmp", path)
    size = os.path.getsize(path)
    assert size <= limit, (path, size)
    print(f"{path}\t{size}\t{size / 2**20:.2f} MiB\t{len(names)} files")
print(f"stage: {len(chosen)} wheels, {len(jars)} jars (Kafka {kafka_version}), {len(bins)} tars",
      file=sys.stderr)
PYEOF

# -- 6. what to send
shopt -s nullglob
stack_tars=("$GPU_DIR"/stack-*.tar)
vllm_tars=("$GPU_DIR"/bundle-*.tar)
repo_mib="$(git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard 2>/dev/null \
  | (cd "$REPO_ROOT" && xargs -0 -r stat -c %s -- 2>/dev/null || true) \
  | awk '{s+=$1} END {printf "%.1f", s/1048576}')"
echo
echo "repo tree that travels with every call: ~${repo_mib} MiB (each call must stay under 64 MiB)"
if ((${#vllm_tars[@]} == 0)); then
  echo "NOTE: no .gpu/bundle-*.tar: stage vLLM first (bash ../shared/gpu/stage-vllm.sh .gpu/wheels)"
fi
echo "device calls (call 1 alone; then the rest back to back, in one message):"
k=0
last_vllm=""
((${#vllm_tars[@]})) && last_vllm="${vllm_tars[-1]}"
for t in "${vllm_tars[@]}" "${stack_tars[@]}"; do
  [[ "$t" == "$last_vllm" ]] && continue
  k=$((k + 1))
  rel=".gpu/$(basename "$t")"
  printf '  %2d. run(command="mkdir -p /root/stage && cp %s /root/stage/", carry=["%s"])   # %s MiB\n' \
    "$k" "$rel" "$rel" "$(awk -v s="$(stat -c %s "$t")" 'BEGIN{printf "%.1f", s/1048576}')"
done
k=$((k + 1))
if [[ -n "$last_vllm" ]]; then
  rel=".gpu/$(basename "$last_vllm")"
  printf '  %2d. run(command="cp %s /root/stage/ && bash deploy/gpu/run.sh '"'"'<command>'"'"'", carry=["%s", ".gpu/install-vllm.sh"], timeout_s=600)\n' \
    "$k" "$rel" "$rel"
else
  printf '  %2d. run(command="bash deploy/gpu/run.sh '"'"'<command>'"'"'", timeout_s=600)\n' "$k"
fi

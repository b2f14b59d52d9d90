# site-lib.sh - sourced by install-stack.sh and install-runbatch.sh (GPU machine).
#
# merge_wheels_into_site PY SITE TAG WHEEL...: pip-installs the wheels (no index, no deps)
# into a scratch dir beside SITE, then moves each top-level entry into SITE, replacing
# what was there and dropping other versions' .dist-info of the same project; SITE/bin is
# merged, not replaced. Why not `pip install --target SITE` directly: pip refuses to
# overwrite (it warns and skips) entries that already exist there, and SITE already holds
# the vLLM kit, so a re-install or an upgrade would silently keep the old files.
# Returns non-zero at the first step that fails (callers run it as `... || die`, where
# bash ignores `set -e` inside the function, so every step is checked here).
merge_wheels_into_site() {
  local py=$1 site=$2 tag=$3
  shift 3
  mkdir -p "$site" || return 1
  local tmp item name rc=0
  tmp="$(mktemp -d "${site%/}.$tag.XXXXXX")" || return 1
  "$py" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index \
    --no-deps --no-compile --target "$tmp" "$@" >&2 || rc=1
  for item in "$tmp"/* "$tmp"/.[!.]*; do
    ((rc == 0)) || break
    [[ -e $item ]] || continue
    name="$(basename "$item")"
    if [[ $name == bin ]]; then
      { mkdir -p "$site/bin" && cp -a "$item/." "$site/bin/"; } || rc=1
      continue
    fi
    if [[ $name == *.dist-info ]]; then # drop other versions of the same project
      rm -rf "$site/${name%%-*}"-*.dist-info || rc=1
    fi
    { rm -rf "${site:?}/$name" && mv "$item" "$site/"; } || rc=1
  done
  rm -rf "$tmp"
  return "$rc"
}

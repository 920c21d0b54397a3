#!/usr/bin/env bash
# build-container-image.sh — the Charliecloud test image: Debian 12 (minbase) with its python3.
#
# Usage: scripts/build-container-image.sh [--force]
#
#   Prints the image's directory and exits 0 at once when it is already built (a `.complete`
#   marker in it). Otherwise, as root with apt: installs `charliecloud-runtime` and `mmdebstrap`
#   when missing, builds the image with `mmdebstrap --variant=minbase --include=python3 bookworm`
#   (it reads the host's apt sources; ~75 s, ~224 MB) into a temporary folder beside the cache and
#   renames it into place, so a half-built image is never seen. --force rebuilds it.
#   The image holds no torch and no cyclone_kit: a job binds the project's virtual environment in
#   at the same path (the container's `host_venv`), as the Slurm tier's container test does.
#   ch-run 0.31 binds only onto folders the image has, and cyclone_kit binds each path a job needs by
#   its top-level folder: every run makes sure the image has the top-level folders of this project,
#   its venv and /tmp (mkdir; cheap, also on a cached image), and copies the host's /etc/hosts into
#   it, as Charliecloud's ch-convert and ch-image do (ch-run does not bind it): the ranks resolve the
#   node names (here the local cluster's c1..g2, which scripts/local-slurm.sh adds to /etc/hosts).
#   Exit status is non-zero on any failure (the Makefile then lets the container tests skip).
#
# Environment:
#   CK_CONTAINER_IMAGES  the cache folder (default /var/tmp/cyclone-images)
#   VENV                 the venv jobs bind in (default: <repo>/.venv)
set -euo pipefail

CACHE=${CK_CONTAINER_IMAGES:-/var/tmp/cyclone-images}
NAME=debian12-python3
IMAGE=$CACHE/$NAME
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

say() { echo "build-container-image: $*" >&2; }
die() { echo "build-container-image: ERROR: $*" >&2; exit 1; }

SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
VENV_DIR=$(cd "${VENV:-$REPO/.venv}" 2>/dev/null && pwd || echo "$REPO/.venv")

# The mount points of the folders jobs bind (top-level folders only; never the image's own system).
mount_points() {
  local top
  for path in "$REPO" "$VENV_DIR" /tmp; do
    top=/$(echo "$path" | cut -d/ -f2)
    case "$top" in /|/usr|/etc|/bin|/sbin|/lib|/lib64|/proc|/sys|/dev|/run|/boot) continue ;; esac
    mkdir -p "$1$top"
  done
  cp /etc/hosts "$1/etc/hosts"
}

if [ "$FORCE" = 0 ] && [ -f "$IMAGE/.complete" ] && command -v ch-run >/dev/null; then
  mount_points "$IMAGE"
  echo "$IMAGE"
  exit 0
fi

need=()
command -v ch-run >/dev/null || need+=(charliecloud-runtime)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ "${#need[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || die "missing ${need[*]} and not root with apt-get: install them, then run this again"
  say "installing ${need[*]}"
  apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; } \
    || die "apt-get install ${need[*]} failed"
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.$NAME.lock"
flock 9
if [ "$FORCE" = 0 ] && [ -f "$IMAGE/.complete" ]; then   # another build finished while we waited
  mount_points "$IMAGE"
  echo "$IMAGE"
  exit 0
fi

TMP=$(mktemp -d "$CACHE/.$NAME.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
say "building $IMAGE with mmdebstrap (~75 s)"
start=$(date +%s)
mmdebstrap --quiet --variant=minbase --include=python3 bookworm "$TMP/root" \
  || die "mmdebstrap failed (it reads the host's apt sources: check 'apt-get update' works)"
mount_points "$TMP/root"
touch "$TMP/root/.complete"
rm -rf "$IMAGE"
mv "$TMP/root" "$IMAGE"
USER=${USER:-$(id -un)} ch-run "$IMAGE" -- python3 -c 'import sys; assert sys.version_info[:2] >= (3, 11)' \
  || die "the image was built but 'ch-run $IMAGE -- python3' does not run"
say "built in $(( $(date +%s) - start )) s"
echo "$IMAGE"

#!/usr/bin/env bash
# fresh-test.sh — `make test` as a fresh machine sees it, RUNS times in a row (issue 27).
#
# Usage: scripts/fresh-test.sh [RUNS]        (default 1; as root, like CI)
#
# Each run: a clean clone of HEAD in a new temporary folder, and, moved aside first, what a clean
# clone would still find on this machine: the local cluster's state root (CK_SLURM_ROOT, default
# /var/tmp/cyclone-slurm), its configuration (/etc/slurm) and the caches under $HOME
# (~/.cache: the Horovod wheel, pip's cache) and the container image (CK_CONTAINER_IMAGES, default
# /var/tmp/cyclone-images, built by scripts/build-container-image.sh). So a set-up step that works only because of leftovers
# fails here first. The local cluster is stopped before and after each run; whatever was moved aside is
# put back at the end, also when the run fails or is stopped (Ctrl-C). Debian packages stay installed
# (what a CI machine of this kind also lacks: the first run of CI installs them; so does `make test`).
# Prints each run's set-up and suite times and exit code; exits non-zero when any run failed.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-1}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "fresh-test: RUNS must be a positive integer, got '$runs'" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "fresh-test: run as root (it moves /etc/slurm and the cluster's state aside, as CI starts without them)" >&2; exit 2; }

aside=$(mktemp -d /var/tmp/fresh-test-aside.XXXXXX)
MOVED=("${CK_SLURM_ROOT:-/var/tmp/cyclone-slurm}" /etc/slurm "${XDG_CACHE_HOME:-$HOME/.cache}"
       "${CK_CONTAINER_IMAGES:-/var/tmp/cyclone-images}")
work=""

stop_cluster() { bash "$1/scripts/local-slurm.sh" stop >/dev/null 2>&1 || true; }
move_aside() {
    local i=0 p
    for p in "${MOVED[@]}"; do
        if [ -e "$p" ]; then mkdir -p "$aside/$i" && mv "$p" "$aside/$i/item"; fi
        i=$((i + 1))
    done
}
put_back() {
    local i=0 p
    for p in "${MOVED[@]}"; do
        if [ -e "$aside/$i/item" ]; then rm -rf "$p"; mkdir -p "$(dirname "$p")"; mv "$aside/$i/item" "$p"; fi
        i=$((i + 1))
    done
}
finish() {
    trap - EXIT INT TERM
    [ -n "$work" ] && stop_cluster "$work"
    put_back
    rm -rf "$aside" "$work"
    echo "fresh-test: put back ${MOVED[*]} (restart the cluster with: make slurm-up)"
}
trap finish EXIT
trap 'exit 130' INT TERM

stop_cluster "$repo"
move_aside
summary=() worst=0
for run in $(seq 1 "$runs"); do
    work=$(mktemp -d /var/tmp/fresh-test-clone.XXXXXX)
    git clone -q "$repo" "$work/clone" || { echo "fresh-test: git clone of $repo failed" >&2; exit 1; }
    t0=$(date +%s)
    (cd "$work/clone" && make setup data slurm-up horovod container-image) >"$work/setup.log" 2>&1
    setup_rc=$? t1=$(date +%s)
    if [ "$setup_rc" = 0 ]; then
        (cd "$work/clone" && bash .ci/run) 2>&1 | tee "$work/test.log" | tail -n 5
        rc=${PIPESTATUS[0]}
    else
        tail -n 40 "$work/setup.log"
        rc=$setup_rc
    fi
    t2=$(date +%s)
    line=$(grep -a '^test suite: ' "$work/test.log" 2>/dev/null | tail -n 1)
    summary+=("run $run: exit $rc; set-up $((t1 - t0)) s; make test $((t2 - t1)) s; ${line:-no suite summary}")
    [ "$rc" -gt "$worst" ] && worst=$rc
    cp "$work/test.log" "/var/tmp/fresh-test-run$run.log" 2>/dev/null
    stop_cluster "$work/clone"
    rm -rf "${MOVED[@]}"   # this run's own state and caches: the next run starts from nothing too
    rm -rf "$work"
    work=""
done
printf 'fresh-test: %s\n' "${summary[@]}"
echo "fresh-test: each run's log: /var/tmp/fresh-test-run{1..$runs}.log"
exit "$worst"

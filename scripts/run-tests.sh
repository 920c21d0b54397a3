#!/usr/bin/env bash
# The full test suite, as `make test` runs it: the Slurm tier beside the unit and integration tiers.
#
# The Slurm tier spends most of its time waiting on the scheduler (a requeued job may not start again
# for cred_expire seconds; batch jobs start on the scheduler's next pass), so it runs in its own pytest
# process while the CPU-bound tiers run in another. Each process writes its own log, printed whole
# when both have ended (never two processes' lines mixed); the suite fails if either failed.
#
# usage: scripts/run-tests.sh PYTHON [PYTEST ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: scripts/run-tests.sh PYTHON [PYTEST ARGS...]}
shift
logs=$(mktemp -d "${TMPDIR:-/tmp}/cyclone-tests.XXXXXX")
common=(-q -ra -p no:cacheprovider --durations=15 "$@")
rest_rc=interrupted slurm_rc=interrupted rest_pid="" slurm_pid=""

show() {
    echo "=============================== unit and integration tiers (exit $rest_rc) ==============================="
    cat "$logs/rest.log" 2>/dev/null
    echo "=============================== Slurm tier (exit $slurm_rc) ==============================="
    cat "$logs/slurm.log" 2>/dev/null
}
# Stopped from outside (a CI time limit, Ctrl-C): end both runs and still show what each had printed.
stopped() {
    trap - INT TERM
    kill -TERM $rest_pid $slurm_pid 2>/dev/null   # (a background job ignores SIGINT)
    wait
    show
    rm -rf "$logs"
    exit 130
}
trap stopped INT TERM
trap 'rm -rf "$logs"' EXIT

started=$(date +%s)
"$py" -m pytest "${common[@]}" tests/slurm >"$logs/slurm.log" 2>&1 &
slurm_pid=$!
"$py" -m pytest "${common[@]}" tests --ignore=tests/slurm >"$logs/rest.log" 2>&1 &
rest_pid=$!
wait "$rest_pid"
rest_rc=$?
wait "$slurm_pid"
slurm_rc=$?

show
echo "test suite: $(( $(date +%s) - started )) s; unit+integration exit $rest_rc, Slurm exit $slurm_rc"
# pytest's codes: 0 passed, 1 failed, 2 interrupted, 3 internal error, 4 usage, 5 nothing collected
[ "$rest_rc" = 0 ] && [ "$slurm_rc" = 0 ] || exit $(( rest_rc > slurm_rc ? rest_rc : slurm_rc ))

#!/usr/bin/env bash
# timing-under-load.sh — the suite's timing-sensitive test files, RUNS times in a row, with a CPU burner on one
# core (issue 27: no verdict may depend on how fast the machine is; "a flaky test is a failed CI").
#
# usage: scripts/timing-under-load.sh PYTHON [RUNS]      (default 3; the local Slurm cluster must be up:
#                                                          `make slurm-up`; `make timing-under-load` does both)
#
# Each round runs the integration files and the Slurm files below side by side (as the first two streams of
# scripts/run-tests.sh pair them) while one more process spins a core the whole time, so every rank,
# scheduler wait and watchdog runs on about half the CPU it gets in the suite. A file is here because its
# verdict is about time or order across processes: a stall bound, a lost node's detection, a signal that
# must land mid-run, a kill while a write is in flight, an input- or communication-bound diagnosis, ranks
# that must stop at the same step. Each makes its condition (tests/helpers/slow_parts.py holds, hooks that
# wait for an event, a throttled rank) instead of hoping the machine produces it; this script is the proof.
# Prints each round's exit codes and wall times; exits non-zero when any round failed. Logs: $LOGS (default
# a new folder under /tmp), one per round and set.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: scripts/timing-under-load.sh PYTHON [RUNS]}
runs=${2:-3}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "timing-under-load: RUNS must be a positive integer, got '$runs'" >&2; exit 2; }
INTEGRATION=(test_stall test_diagnosis test_signals test_signals_metrics test_pipeline_paths test_local_launcher
             test_async_checkpoint test_checkpoint_kill test_ddp)
SLURM=(test_stall_slurm test_restart_in_job test_requeue test_faults)
logs=${LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/timing-under-load.XXXXXX")}
mkdir -p "$logs"
files() { local dir=$1 f; shift; for f in "$@"; do [ -f "tests/$dir/$f.py" ] && echo "tests/$dir/$f.py"; done; }
mapfile -t integ < <(files integration "${INTEGRATION[@]}")
mapfile -t slurm < <(files slurm "${SLURM[@]}")

"$py" -c 'while True: pass' &   # the burner: one core spun for the whole run
burner=$!
trap 'kill "$burner" 2>/dev/null' EXIT
trap 'exit 130' INT TERM

set_run() {  # set_run NAME ROUND FILES...: one pytest run; "NAME rc=RC SECONDS s" into NAME-ROUND.sum
    local name=$1 round=$2 t0 rc
    shift 2
    t0=$(date +%s)
    CK_REQUIRE_SLURM=1 "$py" -m pytest -q -ra -p no:cacheprovider "$@" >"$logs/$name-$round.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t0 )) s: $(tail -n 1 "$logs/$name-$round.log")" >"$logs/$name-$round.sum"
}

worst=0
for round in $(seq 1 "$runs"); do
    set_run integration "$round" "${integ[@]}" &
    a=$!
    set_run slurm "$round" "${slurm[@]}" &
    b=$!
    wait "$a" "$b"
    for name in integration slurm; do
        line=$(cat "$logs/$name-$round.sum")
        echo "timing-under-load: round $round: $line"
        rc=${line#*rc=}; rc=${rc%% *}
        [ "$rc" -gt "$worst" ] && worst=$rc
    done
done
echo "timing-under-load: $runs round(s) with a burner on one core; logs in $logs"
exit "$worst"

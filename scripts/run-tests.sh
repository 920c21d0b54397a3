#!/usr/bin/env bash
# The full test suite, as `make test` runs it, in two phases that keep both cores busy:
#   phase 1: the integration tier (CPU-bound: real gloo ranks) beside the "early" Slurm files (SLURM_EARLY); the
#            notebook's test (EARLY_BESIDE) and then the unit tier, each in whichever of the two is free first;
#   phase 2: the rest of the Slurm tier beside the "beside" integration files (BESIDE), the last of which
#            (BESIDE_LATE) run in whichever of the two is free first.
#
# Why this shape (issue 27, measured with tests/helpers/cpu_time.py's CPU seconds and each tier's "cores busy"):
# the integration tier alone keeps the cores ~73 % busy; the Slurm tier alone ~45 %, its wall time mostly the
# scheduler's waits (Slurm's 60-120 s signal window, requeues, a lost node's detection) and not CPU. Both whole
# tiers side by side ran 1.9-2.5x slower each (2,103 s on a fresh CI machine), one after the other 1,881 s.
# So each phase pairs CPU-bound work with wait-bound work: the Slurm files whose time is mostly waiting
# (SLURM_EARLY: ~700 s of wall, little CPU) run beside the integration tier, and the Slurm files with more
# CPU in their jobs (the pipeline's 8-rank ResNet-18 jobs, the published examples) beside the integration files
# that ask little CPU for their wall time (a CLI a test, users' scripts through the shim, a made slow link or file
# system; ~280 CPU-s). The early branch of phase 1 ended 54-128 s before the integration tier in three fresh runs
# (at 650d9fe) while the unit tier, first in phase 2, kept the cores only 71-75 % busy: the unit tier (~55 CPU-s,
# no process of its own beyond pytest) now fills the end of phase 1 with the notebook's test, in the stream that
# ends its own files first. The two Slurm runs never overlap (phase 2
# starts when phase 1 has ended), so no test's jobs queue behind another run's. Each pytest run writes its own
# log, printed whole when all have ended (never two runs' lines mixed); the suite fails if any run failed.
# No test needs the machine to itself: a test whose verdict needs a condition (a slow link, a slow file system,
# a late rank) makes it (tests/helpers/slow_parts.py), so its verdict holds beside other tests' ranks.
#
# usage: scripts/run-tests.sh PYTHON [PYTEST ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: scripts/run-tests.sh PYTHON [PYTEST ARGS...]}
shift
logs=$(mktemp -d "${TMPDIR:-/tmp}/cyclone-tests.XXXXXX")
# --durations: wall time per test (grows with what runs beside it); tests.helpers.cpu_time: CPU seconds per test
# file (the work each asks of the machine, the same at any load), printed at each tier's end.
common=(-q -ra -p no:cacheprovider -p tests.helpers.cpu_time --durations=40 "$@")
TIERS=(integration early-slurm early-beside slurm unit beside beside-late)
# Integration files that run beside the Slurm tier instead of before it (each asserts no timing).
BESIDE=(test_bad_input test_scripts_local test_script_launch_env test_published_lightning
        test_script_folder_local test_script_cli test_report_cli test_cli test_doctor_cli test_submitit_plan
        test_rendered_scripts_parse test_injection test_contract test_report_time_to_solution test_sweep_local
        test_submitit_local test_api_scripts test_local_plan test_diagnosis test_gpu_check)
# Slurm files that run beside the integration tier (phase 1): their time is mostly the scheduler's waits.
SLURM_EARLY=(test_requeue test_stall_slurm test_restart_in_job test_api_slurm test_sweep_slurm test_faults
             test_container_slurm test_concurrency test_cost_slurm test_status_logs)
# Integration files that end phase 1 (in whichever stream is free first).
EARLY_BESIDE=(test_notebook)
# BESIDE files that end phase 2 (~100 s of its ~350-410 s), in whichever stream is free first: the Slurm tier or
# the other BESIDE files. They start no Slurm job, so they may also run beside the rest of BESIDE.
BESIDE_LATE=(test_bad_input test_sweep_local test_local_plan)
beside=() ignored=() early=() late_ignored=() early_beside=() beside_late=()
for f in "${EARLY_BESIDE[@]}"; do
    if [ -f "tests/integration/$f.py" ]; then
        early_beside+=("tests/integration/$f.py") ignored+=("--ignore=tests/integration/$f.py")
    fi
done
for f in "${BESIDE[@]}"; do
    if [ -f "tests/integration/$f.py" ]; then   # a file renamed or removed is not an error of the suite
        ignored+=("--ignore=tests/integration/$f.py")
        if [[ " ${BESIDE_LATE[*]} " == *" $f "* ]]; then beside_late+=("tests/integration/$f.py")
        else beside+=("tests/integration/$f.py"); fi
    fi
done
for f in "${SLURM_EARLY[@]}"; do
    if [ -f "tests/slurm/$f.py" ]; then
        early+=("tests/slurm/$f.py") late_ignored+=("--ignore=tests/slurm/$f.py")
    fi
done
pids=()

show() {
    for tier in "${TIERS[@]}"; do
        echo "=============================== $tier tier (exit $(cat "$logs/$tier.rc" 2>/dev/null || echo 'not ended')) ==============================="
        cat "$logs/$tier.log" 2>/dev/null
    done
}
# Stopped from outside (a CI time limit, Ctrl-C): end every run and still show what each had printed.
stopped() {
    trap - INT TERM
    for pid in "${pids[@]}"; do   # each stream's pytest run, then the stream itself
        pkill -TERM -P "$pid" 2>/dev/null
        kill -TERM "$pid" 2>/dev/null
    done
    wait
    show
    rm -rf "$logs"
    exit 130
}
trap stopped INT TERM
trap 'rm -rf "$logs"' EXIT

cpu_ticks() {  # "TOTAL IDLE": the machine's CPU time so far in clock ticks (all cores), from /proc/stat's first line
    local _ user nice system idle iowait irq softirq steal
    read -r _ user nice system idle iowait irq softirq steal _ </proc/stat
    echo "$((user + nice + system + idle + iowait + irq + softirq + steal)) $((idle + iowait))"
}

tier() {  # tier NAME PATH...: one pytest run, its output in NAME.log and its exit status in NAME.rc
    local name=$1 t0 total0 idle0 total1 idle1
    shift
    t0=$(date +%s)
    read -r total0 idle0 <<<"$(cpu_ticks)"
    "$py" -m pytest "${common[@]}" "$@" >"$logs/$name.log" 2>&1
    echo $? >"$logs/$name.rc"
    read -r total1 idle1 <<<"$(cpu_ticks)"
    # How busy the cores were while this tier ran (every process on the machine, other tiers included): the
    # room left for moving work beside it (issue 27: where the suite's time goes).
    echo "$(( $(date +%s) - started )) s from the start (this tier $(( $(date +%s) - t0 )) s;" \
         "cores $(( 100 * (total1 - total0 - idle1 + idle0) / (total1 - total0 > 0 ? total1 - total0 : 1) )) % busy meanwhile)" \
         >"$logs/$name.end"
}

# The end of phase 1: the notebook's test, then the unit tier, each taken by whichever stream of phase 1 is free
# first (mkdir claims it: atomic), so that a machine on which one stream runs late does not leave the other idle.
flex() {
    if mkdir "$logs/claim-early-beside" 2>/dev/null; then
        if [ ${#early_beside[@]} -gt 0 ]; then tier early-beside "${early_beside[@]}"
        else echo 0 >"$logs/early-beside.rc"; fi
    fi
    if mkdir "$logs/claim-unit" 2>/dev/null; then tier unit tests/unit; fi
}

started=$(date +%s)
# phase 1 (in the background, so that a stop from outside is acted on at once)
( tier integration tests/integration "${ignored[@]}"; flex ) &
pids+=($!)
( if [ ${#early[@]} -gt 0 ]; then tier early-slurm "${early[@]}"; else echo 0 >"$logs/early-slurm.rc"; fi; flex ) &
pids+=($!)
wait
# phase 2
late() {  # the end of phase 2, as flex() ends phase 1
    if mkdir "$logs/claim-beside-late" 2>/dev/null; then
        if [ ${#beside_late[@]} -gt 0 ]; then tier beside-late "${beside_late[@]}"
        else echo 0 >"$logs/beside-late.rc"; fi
    fi
}
( tier slurm tests/slurm "${late_ignored[@]}"; late ) &
pids+=($!)
( if [ ${#beside[@]} -gt 0 ]; then tier beside "${beside[@]}"; else echo 0 >"$logs/beside.rc"; fi; late ) &
pids+=($!)
wait

show
codes=() worst=0
for t in "${TIERS[@]}"; do
    rc=$(cat "$logs/$t.rc" 2>/dev/null || echo 3)
    codes+=("$t $rc, ended $(cat "$logs/$t.end" 2>/dev/null || echo never)")
    [ "$rc" -gt "$worst" ] && worst=$rc
done
echo "test suite: $(( $(date +%s) - started )) s; exit codes: $(printf '%s; ' "${codes[@]}")"
# pytest's codes: 0 passed, 1 failed, 2 interrupted, 3 internal error, 4 usage, 5 nothing collected
exit "$worst"

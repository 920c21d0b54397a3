#!/usr/bin/env bash
# The full test suite, as `make test` runs it, in three streams that keep both cores busy:
#   the integration tier (CPU-bound: real gloo ranks), then the next tiers of QUEUE;
#   the "early" Slurm files (SLURM_EARLY: mostly the scheduler's waits), then the next tiers of QUEUE;
#   the unit tier (pytest alone, ~55-110 CPU-s) in the room the two others leave, then the next tiers of QUEUE.
# QUEUE: the notebook's test (EARLY_BESIDE), the rest of the Slurm tier (after the early Slurm files), the
# "beside" integration files (BESIDE), the last of them (BESIDE_LATE); each taken by whichever stream is free.
# The unit stream, free first, takes the notebook's test and the beside files while the Slurm tier waits for
# the early Slurm files; a machine whose integration tier is slow (1,095 s at 6c4effa on a machine where
# `import torch` took 2.3 s, against 734 s on the CI machine) then no longer ends the suite with them.
#
# Why this shape (issue 27, measured with tests/helpers/cpu_time.py's CPU seconds and each tier's "cores busy"):
# the integration tier alone keeps the cores ~73 % busy; the Slurm tier alone ~45 %, its wall time mostly the
# scheduler's waits (Slurm's 60-120 s signal window, requeues, a lost node's detection) and not CPU. Both whole
# tiers side by side ran 1.9-2.5x slower each (2,103 s on a fresh CI machine), one after the other 1,881 s.
# So CPU-bound work runs beside wait-bound work: the Slurm files whose time is mostly waiting run beside the
# integration tier, and the Slurm files with more CPU in their jobs (the pipeline's two 4-rank jobs, requeued, the
# published examples) beside the integration files that ask little CPU for their wall time (a CLI a test,
# users' scripts through the shim, a made slow link or file system; ~280 CPU-s). Until 6c4effa the suite ran
# in two phases with a barrier between them: on the CI machine phase 1 kept the cores 84-85 % busy and its
# end (the unit tier alone, one pytest process) 44 %, ~50 s of one idle core. The two Slurm runs never overlap,
# so no test's jobs queue behind another run's. Each pytest run writes its own log, printed whole when all have
# ended (never two runs' lines mixed); the suite fails if any run failed.
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
        test_submitit_local test_api_scripts test_local_plan test_diagnosis test_gpu_check test_gpu_matrix)
# Slurm files that run beside the integration tier: their time is mostly the scheduler's waits.
SLURM_EARLY=(test_requeue test_stall_slurm test_restart_in_job test_api_slurm test_sweep_slurm test_faults
             test_container_slurm test_concurrency test_cost_slurm test_status_logs)
# Integration files first in QUEUE (in whichever stream is free first).
EARLY_BESIDE=(test_notebook)
# BESIDE files last in QUEUE (~100 s of BESIDE's ~350-410 s, and test_gpu_matrix: ~190 CPU-s), in whichever
# stream is free first: the Slurm tier's or the other BESIDE files'. They start no Slurm job, so they may also run
# beside the rest of BESIDE. test_gpu_matrix (its verdicts read no clock) moved here from the integration tier
# once core.prefork had cut the tier's CPU (964 CPU-s; it was the long pole at 1,282 s while the stream that
# took BESIDE ended at 841 s).
BESIDE_LATE=(test_bad_input test_sweep_local test_local_plan test_gpu_matrix)
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

# When a stream's own tier ends, it takes the next tier of QUEUE (mkdir claims it: atomic), so no core waits
# for another stream. The rest of the Slurm tier waits for the early Slurm files: a stream that finds it not
# ready takes the next tier, or waits a second and looks again.
QUEUE=(early-beside slurm beside beside-late)
ready() { [ "$1" != slurm ] || [ -f "$logs/early-slurm.rc" ]; }
run_item() {
    case $1 in
        early-beside) if [ ${#early_beside[@]} -gt 0 ]; then tier early-beside "${early_beside[@]}"
                      else echo 0 >"$logs/early-beside.rc"; fi ;;
        slurm) tier slurm tests/slurm "${late_ignored[@]}" ;;
        beside) if [ ${#beside[@]} -gt 0 ]; then tier beside "${beside[@]}"; else echo 0 >"$logs/beside.rc"; fi ;;
        beside-late) if [ ${#beside_late[@]} -gt 0 ]; then tier beside-late "${beside_late[@]}"
                     else echo 0 >"$logs/beside-late.rc"; fi ;;
    esac
}
next_tiers() {  # take QUEUE's tiers in order until none is left; one not ready yet is waited for or passed
    local item left
    while :; do
        left=0
        for item in "${QUEUE[@]}"; do
            [ -d "$logs/claim-$item" ] && continue
            left=1
            if ready "$item" && mkdir "$logs/claim-$item" 2>/dev/null; then
                run_item "$item"
                continue 2
            fi
        done
        [ "$left" -eq 0 ] && return
        sleep 1
    done
}

# The machine's speed, for comparing suite times across machines (the suite is CPU-bound: its wall time scales
# with it): one cold-ish `import torch`, before the clock starts. 1.2-1.4 s on the machines that measured the
# suite at 1,177-1,290 s; 2.3 s on one that took 1,484 s.
t_import=$(date +%s%N)
"$py" -c "import torch" >/dev/null 2>&1
t_import=$(( ($(date +%s%N) - t_import) / 1000000 ))
started=$(date +%s)
# in the background, so that a stop from outside is acted on at once
( tier integration tests/integration "${ignored[@]}"; next_tiers ) &
pids+=($!)
( if [ ${#early[@]} -gt 0 ]; then tier early-slurm "${early[@]}"; else echo 0 >"$logs/early-slurm.rc"; fi
  next_tiers ) &
pids+=($!)
( tier unit tests/unit; next_tiers ) &
pids+=($!)
wait

show
codes=() worst=0
for t in "${TIERS[@]}"; do
    rc=$(cat "$logs/$t.rc" 2>/dev/null || echo 3)
    codes+=("$t $rc, ended $(cat "$logs/$t.end" 2>/dev/null || echo never)")
    [ "$rc" -gt "$worst" ] && worst=$rc
done
echo "test suite: $(( $(date +%s) - started )) s (this machine: import torch $((t_import / 1000)).$(printf '%03d' $((t_import % 1000))) s); exit codes: $(printf '%s; ' "${codes[@]}")"
# pytest's codes: 0 passed, 1 failed, 2 interrupted, 3 internal error, 4 usage, 5 nothing collected
exit "$worst"

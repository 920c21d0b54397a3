#!/usr/bin/env bash
# GPU check: ResNet-50, synthetic data, bf16 autocast + channels_last, batch 256, on one NVIDIA GPU.
#
# Stages (each a fresh process, images/s = median of the 10-step windows after the first, the
# runtime's own steady-state definition; the bare loop is bench/plain_ddp.py measuring the same way):
#   1. bare loop, eager              (hand-written: model, SGD, autocast, channels_last; no DDP)
#   2. cyclone_kit runtime, eager    (python -m cyclone_kit run SPEC --nproc 1: launcher + runtime)
#   3. bare loop + 1-rank NCCL process group + DDP, eager   (NCCL init, DDP reducer on one GPU)
#   4. bare loop, torch.compile
#   5. cyclone_kit runtime, torch.compile (train.compile=true)
# then prints images/s per GPU and the ratios runtime/bare (eager, compile) and DDP-NCCL/bare.
# Sized for < 5 minutes on an H100/H200-class GPU: each stage has a timeout and a stage that would
# start after the time budget is skipped (and said so), so the script always ends with a summary.
#
# Output: stdout, and when $OUT is set: $OUT/gpu_check.txt (everything printed), $OUT/gpu_check.json
# (the figures) and $OUT/metrics-*.jsonl (the runtime's metrics files).
#
# CPU mode, to know the script works without a GPU: CK_GPU_CHECK_CPU=1 (or --cpu) runs the very
# same stages on the CPU with a tiny model (tiny_cnn, 32 px, batch 8, 4 steps, gloo instead of
# NCCL, bf16 autocast still on); compile stages are skipped unless CK_GPU_CHECK_COMPILE=1.
#
# Usage: bash bench/gpu_check.sh [--cpu]      (from the repository root or anywhere)
# Exit:  0 every stage ran; 1 a stage failed; 2 no CUDA (GPU mode); 3 a stage was skipped or timed out.
# Env:   PYTHON (default: .venv/bin/python, else python3), CK_GPU_CHECK_BUDGET_S (default 270),
#        CK_GPU_CHECK_STEPS (default 50 eager / 40 compile).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
CPU_MODE="${CK_GPU_CHECK_CPU:-0}"
[[ "${1:-}" == "--cpu" || "${1:-}" == "--dry-run" ]] && CPU_MODE=1
BUDGET_S="${CK_GPU_CHECK_BUDGET_S:-270}"
WORK="$(mktemp -d -t ck-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
LOG="$WORK/gpu_check.txt"
: >"$LOG"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$LOG"; }

if [[ "$CPU_MODE" == 1 ]]; then
  MODEL=tiny_cnn; SIZE=32; CLASSES=10; BATCH=8; EAGER_STEPS=4; COMPILE_STEPS=4; LOG_EVERY=1
  DEVICE=cpu; RUN_FLAGS=(--cpu --threads 1); DO_COMPILE="${CK_GPU_CHECK_COMPILE:-0}"
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
else
  MODEL=resnet50; SIZE=224; CLASSES=1000; BATCH=256; LOG_EVERY=10
  EAGER_STEPS="${CK_GPU_CHECK_STEPS:-50}"; COMPILE_STEPS="${CK_GPU_CHECK_STEPS:-40}"
  DEVICE=cuda; RUN_FLAGS=(); DO_COMPILE="${CK_GPU_CHECK_COMPILE:-1}"
fi

say "== cyclone_kit gpu_check $(date -u '+%Y-%m-%d %H:%M:%S') UTC, host $(hostname), mode $([[ $CPU_MODE == 1 ]] && echo CPU-smoke || echo GPU)"
say "== git $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'), python $PY"
if [[ "$CPU_MODE" != 1 ]]; then
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv,noheader 2>&1 \
      | sed 's/^/gpu: /' | tee -a "$LOG"
  else
    say "gpu: nvidia-smi not found"
  fi
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import os, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}, "
      f"devices {torch.cuda.device_count()}, cpus {os.cpu_count()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}, bf16 {torch.cuda.is_bf16_supported()}, "
          f"nccl {torch.cuda.nccl.version() if hasattr(torch.cuda, 'nccl') else '?'}")
EOF
if [[ "$CPU_MODE" != 1 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "error: CUDA is not available here. HINT: run on a machine with an NVIDIA GPU, or CK_GPU_CHECK_CPU=1 for the CPU smoke mode"
  exit 2
fi
say "== workload: $MODEL, ${SIZE}px synthetic, batch $BATCH, bf16 autocast, channels_last, device $DEVICE; budget ${BUDGET_S}s"

# spec for the runtime stages
cat >"$WORK/spec.toml" <<EOF
name = "gpu-check"

[train]
model = "$MODEL"
dataset = "synthetic"
image_size = $SIZE
num_classes = $CLASSES
synthetic_samples = 100000
steps = $EAGER_STEPS
batch_size = $BATCH
lr = 0.1
lr_scaling = "none"
precision = "bf16"
channels_last = true
log_every = $LOG_EVERY
val_every_epochs = 0
seed = 0

[resources]
profile = "local"

[checkpoint]
every_steps = 0
resume = false
requeue = false
EOF

declare -A RATE
STATUS_OK=1
PARTIAL=0

time_left() { echo $(( BUDGET_S - SECONDS )); }

# stage NAME TIMEOUT_S MIN_LEFT_S KIND [args...]; KIND = bare|runtime. Stores images/s in RATE[NAME].
stage() {
  local name="$1" tmo="$2" need="$3" kind="$4"; shift 4
  local left; left=$(time_left)
  if (( left < need )); then
    say "-- $name: SKIPPED (time budget: ${left}s left, needs ~${need}s)"
    RATE[$name]=""; PARTIAL=1; return 0
  fi
  (( tmo > left )) && tmo=$left
  say "-- $name (timeout ${tmo}s)"
  local t0=$SECONDS out="$WORK/$name.json" rc=0
  if [[ "$kind" == bare ]]; then
    timeout -k 10 "$tmo" "$PY" bench/plain_ddp.py --device "$DEVICE" --bf16 --channels-last --model "$MODEL" \
      --image-size "$SIZE" --num-classes "$CLASSES" --batch "$BATCH" --log-every "$LOG_EVERY" \
      --threads "$(nproc)" --pool "$BATCH" --out "$out" "$@" >"$WORK/$name.out" 2>&1 || rc=$?
  else
    timeout -k 10 "$tmo" "$PY" -m cyclone_kit run "$WORK/spec.toml" --nproc 1 --runs-dir "$WORK/runs" --quiet \
      "${RUN_FLAGS[@]}" "$@" >"$WORK/$name.out" 2>&1 || rc=$?
  fi
  if (( rc == 124 || rc == 137 )); then
    say "   TIMED OUT after $((SECONDS - t0))s (stage limit ${tmo}s); no figure. Last lines:"
    tail -n 5 "$WORK/$name.out" | sed 's/^/   | /' | tee -a "$LOG"
    RATE[$name]=""; PARTIAL=1; return 0
  fi
  if (( rc != 0 )); then
    say "   FAILED (exit $rc after $((SECONDS - t0))s); last lines:"
    tail -n 15 "$WORK/$name.out" | sed 's/^/   | /' | tee -a "$LOG"
    find "$WORK/runs" -name 'rank-0.err' -newer "$WORK/spec.toml" -exec tail -n 15 {} \; 2>/dev/null | sed 's/^/   | /' | tee -a "$LOG"
    RATE[$name]=""; STATUS_OK=0; return 0
  fi
  local rate info
  if [[ "$kind" == bare ]]; then
    info=$("$PY" - "$out" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["samples_per_s"])
print(f"   bare: device {d['device']}, bf16 {d['bf16']}, channels_last {d['channels_last']}, compile {d['compile']}, "
      f"process group {d['backend'] or 'none'}; windows: " + ", ".join(f"{r:.0f}" for r in d["window_rates"]))
EOF
)
  else
    local rundir; rundir=$(sed -n 's/^run dir: //p' "$WORK/$name.out" | tail -n 1)
    [[ -n "${OUT:-}" ]] && mkdir -p "$OUT" && cp "$rundir/metrics.jsonl" "$OUT/metrics-$name.jsonl"
    info=$("$PY" - "$rundir/metrics.jsonl" <<'EOF'
import json, sys
recs = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
end = [r for r in recs if r["kind"] == "end"][-1]
start = [r for r in recs if r["kind"] == "start"][-1]
print(end["samples_per_s"])
print(f"   runtime: precision {start['precision']}, device {start['device_name']}, status {end['status']}; windows: "
      + ", ".join(f"{r['samples_per_s']:.0f}" for r in recs if r["kind"] == "step"))
EOF
)
  fi
  rate=$(head -n 1 <<<"$info")
  say "$(tail -n +2 <<<"$info")"
  RATE[$name]="$rate"
  say "   $(printf '%.1f' "$rate") images/s  ($((SECONDS - t0))s)"
}

stage bare_eager 90 30 bare --steps "$EAGER_STEPS"
stage runtime_eager 90 30 runtime
stage bare_ddp_nccl_eager 90 30 bare --steps "$EAGER_STEPS" --ddp
if [[ "$DO_COMPILE" == 1 ]]; then
  stage bare_compile 150 60 bare --steps "$COMPILE_STEPS" --compile
  stage runtime_compile 150 60 runtime --set train.compile=true --set "train.steps=$COMPILE_STEPS"
else
  say "-- compile stages: skipped (CK_GPU_CHECK_COMPILE=0)"
  RATE[bare_compile]=""; RATE[runtime_compile]=""
fi

# ratio NAME_A NAME_B: RATE[A] / RATE[B] to 3 decimals, or n/a when either is missing.
ratio() {
  local a="${RATE[$1]:-}" b="${RATE[$2]:-}"
  if [[ -n "$a" && -n "$b" ]]; then "$PY" -c "print(f'{$a / $b:.3f}')"; else echo "n/a"; fi
}
fmt() { if [[ -n "${RATE[$1]:-}" ]]; then printf '%.1f' "${RATE[$1]}"; else echo "n/a"; fi; }
PG_NAME=$([[ "$CPU_MODE" == 1 ]] && echo "gloo (CPU mode)" || echo NCCL)
say ""
say "== summary ($MODEL, batch $BATCH, bf16 + channels_last, images/s per GPU; total ${SECONDS}s)"
say "   eager:   runtime $(fmt runtime_eager)  bare $(fmt bare_eager)  ratio runtime/bare $(ratio runtime_eager bare_eager)  (target >= 0.99)"
say "   compile: runtime $(fmt runtime_compile)  bare $(fmt bare_compile)  ratio runtime/bare $(ratio runtime_compile bare_compile)  (target >= 0.99)"
say "   1-rank $PG_NAME process group + DDP (bare loop): $(fmt bare_ddp_nccl_eager)  vs bare eager ratio $(ratio bare_ddp_nccl_eager bare_eager)"
say "   compile speed-up: runtime $(ratio runtime_compile runtime_eager)  bare $(ratio bare_compile bare_eager)"

"$PY" - "$WORK/gpu_check.json" "$MODEL" "$BATCH" "$CPU_MODE" "$SECONDS" \
  "${RATE[bare_eager]:-}" "${RATE[runtime_eager]:-}" "${RATE[bare_ddp_nccl_eager]:-}" \
  "${RATE[bare_compile]:-}" "${RATE[runtime_compile]:-}" <<'EOF'
import json, sys
path, model, batch, cpu, secs, *rates = sys.argv[1:]
names = ["bare_eager", "runtime_eager", "bare_ddp_nccl_eager", "bare_compile", "runtime_compile"]
json.dump({"model": model, "batch": int(batch), "cpu_mode": cpu == "1", "seconds": int(secs),
           "images_per_s": {n: (float(r) if r else None) for n, r in zip(names, rates)}}, open(path, "w"), indent=1)
EOF
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT" && cp "$LOG" "$WORK/gpu_check.json" "$OUT/" && say "== written to $OUT/gpu_check.txt and $OUT/gpu_check.json"
fi
if [[ "$STATUS_OK" != 1 ]]; then
  say "== some stages FAILED (see above)"
  exit 1
fi
if [[ "$PARTIAL" == 1 ]]; then
  say "== some stages were skipped or timed out (time budget ${BUDGET_S}s): raise CK_GPU_CHECK_BUDGET_S or lower CK_GPU_CHECK_STEPS"
  exit 3
fi
exit 0

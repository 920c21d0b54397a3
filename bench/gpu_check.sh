#!/usr/bin/env bash
# GPU check: ResNet-50, synthetic data, bf16 autocast + channels_last, batch 256, on one NVIDIA GPU.
#
# Stages (each a fresh process, images/s = median of the 10-step windows after the first, the
# runtime's own steady-state definition; the bare loop is bench/plain_ddp.py measuring the same way):
#   1. bare loop, eager              (hand-written: model, SGD, autocast, channels_last; no DDP)
#   2. cyclone_kit runtime, eager    (python -m cyclone_kit run SPEC --nproc 1: launcher + runtime)
#   3. bare loop + 1-rank NCCL process group + DDP, eager   (NCCL init, DDP reducer on one GPU)
#   4. bare loop, torch.compile
#   5. cyclone_kit runtime, fp16 + GradScaler   (train.precision=fp16: the V100 path)
#   6. FSDP (world 1, fully_shard over a 1-rank NCCL group) with channels_last on (issue 16 item 2)
#   7. ImageFolder run with DataLoader workers, SIGTERM to the rank's process group (as Slurm signals
#      a step): must end "preempted" with a checkpoint (issue 16 item 10)
#   8. cyclone_kit runtime, torch.compile (train.compile=true)
#   9. cyclone_kit runtime, torch.compile + grad_accum 2 (DDP no_sync under compile)
# then prints images/s per GPU and the ratios runtime/bare (eager, compile) and DDP-NCCL/bare.
# Sized for < 8 minutes with a cold compile cache on an H100/H200-class GPU: each stage has a
# timeout and a stage that would start after the time budget is skipped (and said so), so the
# script always ends with a summary.
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
# Env:   PYTHON (default: .venv/bin/python, else python3), CK_GPU_CHECK_BUDGET_S (default 450),
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
BUDGET_S="${CK_GPU_CHECK_BUDGET_S:-450}"
WORK="$(mktemp -d -t ck-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
LOG="$WORK/gpu_check.txt"
: >"$LOG"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$LOG"; }

if [[ "$CPU_MODE" == 1 ]]; then
  MODEL=tiny_cnn; SIZE=32; CLASSES=10; BATCH=8; EAGER_STEPS=4; COMPILE_STEPS=4; LOG_EVERY=1
  FOLDER_SIZE=16; FOLDER_IMAGES=16; FOLDER_WORKERS=2; FOLDER_BATCH=4; FSDP_BATCH=8; FSDP_STEPS=4
  DEVICE=cpu; RUN_FLAGS=(--cpu --threads 1); DO_COMPILE="${CK_GPU_CHECK_COMPILE:-0}"
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
else
  MODEL=resnet50; SIZE=224; CLASSES=1000; BATCH=256; LOG_EVERY=10
  EAGER_STEPS="${CK_GPU_CHECK_STEPS:-50}"; COMPILE_STEPS="${CK_GPU_CHECK_STEPS:-40}"
  DEVICE=cuda; RUN_FLAGS=(); DO_COMPILE="${CK_GPU_CHECK_COMPILE:-1}"
  FOLDER_SIZE=64; FOLDER_IMAGES=256; FOLDER_WORKERS=4; FOLDER_BATCH=32; FSDP_BATCH=64; FSDP_STEPS=20
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
stage runtime_fp16 90 30 runtime --set train.precision=fp16

declare -A CHECK
# check NAME TIMEOUT_S MIN_LEFT_S FUNCTION: a pass/fail stage; CHECK[NAME] = PASS / FAIL / SKIPPED.
check() {
  local name="$1" tmo="$2" need="$3" fn="$4" left rc=0 t0=$SECONDS
  left=$(time_left)
  if (( left < need )); then
    say "-- $name: SKIPPED (time budget: ${left}s left, needs ~${need}s)"; CHECK[$name]=SKIPPED; PARTIAL=1; return 0
  fi
  (( tmo > left )) && tmo=$left
  say "-- $name (timeout ${tmo}s)"
  "$fn" "$tmo" >"$WORK/$name.out" 2>&1 || rc=$?
  sed 's/^/   | /' "$WORK/$name.out" | tail -n 12 | tee -a "$LOG"
  if (( rc == 0 )); then CHECK[$name]=PASS; else CHECK[$name]="FAIL(exit $rc)"; STATUS_OK=0; fi
  say "   ${CHECK[$name]}  ($((SECONDS - t0))s)"
}

# FSDP over a 1-rank group with channels_last on: the runtime's own place_model + wrap_model.
fsdp_channels_last() {
  timeout -k 10 "$1" "$PY" - "$DEVICE" "$MODEL" "$SIZE" "$CLASSES" "$FSDP_BATCH" "$FSDP_STEPS" <<'PYEOF'
import datetime, socket, sys, time
import torch, torch.distributed as dist
from cyclone_kit.config import TrainConfig
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.models import build_model
from cyclone_kit.runtime.train import place_model, wrap_model
kind, model_name, size, classes, batch, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
device = DeviceChoice(kind, 0 if kind == "cuda" else None, kind, "nccl" if kind == "cuda" else "gloo")
dev = torch.device(device.torch_device)
if kind == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group(device.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=120),
                        **({"device_id": dev} if kind == "cuda" else {}))
model = place_model(build_model(model_name, classes, size, 3), dev, "fsdp", True)
model = wrap_model("fsdp", model, device, TrainConfig(), True)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(batch, 3, size, size, device=dev).to(memory_format=torch.channels_last)
y = torch.randint(0, classes, (batch,), device=dev)
t0 = None
for i in range(steps + 2):
    if i == 2:
        torch.cuda.synchronize() if kind == "cuda" else None
        t0 = time.perf_counter()
    with torch.autocast(device_type=kind, dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
loss_value = float(loss.detach())
rate = batch * steps / (time.perf_counter() - t0)
print(f"fsdp world 1, channels_last inputs, sharded params contiguous: loss {loss_value:.3f}, {rate:.1f} images/s")
dist.destroy_process_group()
PYEOF
}

# ImageFolder + DataLoader workers; SIGTERM to the rank's process group; expect "preempted" + a checkpoint.
imagefolder_sigterm() {
  local data="$WORK/images" runs="$WORK/runs-folder" pid rundir rank_pid n
  "$PY" - "$data" "$FOLDER_IMAGES" "$FOLDER_SIZE" <<'PYEOF' || return 1
import sys
from pathlib import Path
import numpy as np
from PIL import Image
root, per_class, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
for c in range(2):
    (root / "train" / f"c{c}").mkdir(parents=True, exist_ok=True)
    for i in range(per_class):
        Image.fromarray(rng.integers(0, 256, (size + 8, size + 12, 3), dtype=np.uint8)).save(root / "train" / f"c{c}" / f"{i}.png")
PYEOF
  "$PY" -m cyclone_kit run "$WORK/spec.toml" --nproc 1 --runs-dir "$runs" --quiet "${RUN_FLAGS[@]}" \
    --set train.dataset=imagefolder --set "train.data_dir=$data" --set "train.image_size=$FOLDER_SIZE" \
    --set train.num_classes=2 --set "train.batch_size=$FOLDER_BATCH" --set "train.num_workers=$FOLDER_WORKERS" \
    --set train.steps=1000000 --set train.log_every=1 --set checkpoint.every_steps=0 \
    >"$WORK/folder-run.out" 2>&1 &
  pid=$!
  local deadline=$(( SECONDS + $1 ))
  rundir=""; rank_pid=""
  while (( SECONDS < deadline )) && kill -0 "$pid" 2>/dev/null; do
    [[ -z "$rundir" ]] && rundir=$(sed -n 's/^run dir: //p' "$WORK/folder-run.out" | tail -n 1)
    if [[ -n "$rundir" && -f "$rundir/metrics.jsonl" ]]; then
      n=$(grep -c '"kind": *"step"' "$rundir/metrics.jsonl" || true)
      if (( n >= 3 )); then
        rank_pid=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["ranks"][0]["pid"])' "$rundir/launch.json")
        break
      fi
    fi
    sleep 0.5
  done
  if [[ -z "$rank_pid" ]]; then
    echo "the run did not log 3 steps"; tail -n 20 "$WORK/folder-run.out"; kill -9 "$pid" 2>/dev/null; return 1
  fi
  echo "workers of rank pid $rank_pid: $(cat /proc/"$rank_pid"/task/*/children 2>/dev/null | wc -w) child process(es)"
  kill -TERM -- "-$rank_pid"
  local rc=0
  while (( SECONDS < deadline )) && kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && { echo "run still alive at the deadline"; kill -9 "$pid"; return 1; }
  wait "$pid" || rc=$?
  "$PY" - "$rundir" "$rc" <<'PYEOF'
import json, sys
from pathlib import Path
run, rc = Path(sys.argv[1]), int(sys.argv[2])
ends = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"end"' in x]
ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.pt")) if (run / "checkpoints").is_dir() else []
status = ends[-1]["status"] if ends else None
print(f"exit {rc}, end status {status}, checkpoints {ckpts}")
if rc != 0 or status != "preempted" or not ckpts:
    err = run / "logs" / "rank-0.err"
    print(err.read_text()[-1500:] if err.is_file() else "(no rank log)")
    sys.exit(1)
PYEOF
}

check fsdp_channels_last 120 30 fsdp_channels_last
check imagefolder_sigterm 120 40 imagefolder_sigterm

if [[ "$DO_COMPILE" == 1 ]]; then
  stage bare_compile 150 60 bare --steps "$COMPILE_STEPS" --compile
  stage runtime_compile 150 60 runtime --set train.compile=true --set "train.steps=$COMPILE_STEPS"
  stage runtime_compile_accum2 150 60 runtime --set train.compile=true --set train.grad_accum=2 \
    --set "train.steps=$(( (COMPILE_STEPS + 1) / 2 ))"
else
  say "-- compile stages: skipped (CK_GPU_CHECK_COMPILE=0)"
  RATE[bare_compile]=""; RATE[runtime_compile]=""; RATE[runtime_compile_accum2]=""
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
say "   fp16 + GradScaler (runtime): $(fmt runtime_fp16)  vs bf16 ratio $(ratio runtime_fp16 runtime_eager)"
say "   compile + grad_accum 2 (runtime): $(fmt runtime_compile_accum2)"
say "   FSDP world 1 + channels_last: ${CHECK[fsdp_channels_last]}   ImageFolder workers + SIGTERM -> preempted + checkpoint: ${CHECK[imagefolder_sigterm]}"

"$PY" - "$WORK/gpu_check.json" "$MODEL" "$BATCH" "$CPU_MODE" "$SECONDS" \
  "${RATE[bare_eager]:-}" "${RATE[runtime_eager]:-}" "${RATE[bare_ddp_nccl_eager]:-}" \
  "${RATE[bare_compile]:-}" "${RATE[runtime_compile]:-}" "${RATE[runtime_fp16]:-}" \
  "${RATE[runtime_compile_accum2]:-}" "${CHECK[fsdp_channels_last]}" "${CHECK[imagefolder_sigterm]}" <<'EOF'
import json, sys
path, model, batch, cpu, secs, *rest = sys.argv[1:]
rates, checks = rest[:7], rest[7:]
names = ["bare_eager", "runtime_eager", "bare_ddp_nccl_eager", "bare_compile", "runtime_compile", "runtime_fp16",
         "runtime_compile_accum2"]
json.dump({"model": model, "batch": int(batch), "cpu_mode": cpu == "1", "seconds": int(secs),
           "images_per_s": {n: (float(r) if r else None) for n, r in zip(names, rates)},
           "checks": dict(zip(["fsdp_channels_last", "imagefolder_sigterm"], checks))}, open(path, "w"), indent=1)
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

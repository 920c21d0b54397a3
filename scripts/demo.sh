#!/usr/bin/env bash
# `make demo`: a local strong-scaling study (1 and 2 CPU processes, tiny CNN) and its scaling report.
# Real Fashion-MNIST when Debian's dataset-fashion-mnist is installed, synthetic images otherwise.
# Usage: scripts/demo.sh [RUNS_DIR [SWEEP OPTIONS...]]   (default: runs); PYTHON=... picks the interpreter.
# SWEEP OPTIONS go to `cyclone-kit sweep` after the demo's own, so they win: e.g. a smaller study,
#   scripts/demo.sh runs --set train.dataset=synthetic --set train.synthetic_samples=2048
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
RUNS="${1:-runs}"
shift $(( $# > 0 ? 1 : 0 ))
DATA=/usr/share/datasets/fashion-mnist
ARGS=()
if [ -f "$DATA/train-images-idx3-ubyte.gz" ] || [ -f "$DATA/train-images-idx3-ubyte" ]; then
    echo "demo: real Fashion-MNIST from $DATA"
    ARGS+=(--set train.dataset=fashion_mnist --set "train.data_dir=$DATA")
else
    echo "demo: Fashion-MNIST not installed (apt-get install dataset-fashion-mnist); using synthetic images"
fi

start=$(date +%s)
status=0
"$PY" -m cyclone_kit sweep jobs/demo_strong.toml --backend local --runs-dir "$RUNS" --quiet "${ARGS[@]}" "$@" || status=$?
study=$(ls -1dt "$RUNS"/demo-strong-* 2>/dev/null | head -n 1 || true)
echo
if [ -z "$study" ]; then
    echo "demo: no study directory was created" >&2
    exit "${status:-1}"
fi
echo "demo finished in $(( $(date +%s) - start )) s (exit $status)"
echo "  study:   $study"
echo "  table:   $study/report/scaling.csv"
echo "  report:  $study/report/report.html  (and report.md, plots as PNG/SVG)"
if [ -f "$study/report/scaling.csv" ]; then
    echo
    cat "$study/report/scaling.csv"
fi
exit "$status"

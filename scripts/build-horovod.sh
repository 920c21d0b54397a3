#!/usr/bin/env bash
# build-horovod.sh — build Horovod 0.28.1 (PyTorch + Gloo, CPU ops) against the venv's torch.
#
# Usage: scripts/build-horovod.sh [--force]
#
#   Exits 0 at once when `import horovod.torch` already works in the venv. Otherwise installs the
#   cached wheel when there is one (seconds), else builds the wheel from the PyPI sdist (~8 min on
#   2 cores), caches it and installs it. --force rebuilds even when a cached wheel exists.
#   Exit status is non-zero on any failure (the Makefile then skips the Horovod tests).
#
# Environment:
#   VENV                 the venv to build against / install into (default: <repo>/.venv)
#   CK_HOROVOD_CACHE     wheel cache (default ${XDG_CACHE_HOME:-$HOME/.cache}/cyclone_kit/wheels)
#   CK_HOROVOD_JOBS      parallel compile jobs (default 2)
#
# Horovod 0.28.1 does not build against torch 2.14 as released (shared/STACK-FACTS.md, "MPI and
# Horovod"). The fixes applied to the unpacked sdist / build:
#   1. pip --no-build-isolation, so the build sees the venv's torch;
#   2. CUDA off: cmake/Modules/FindPytorch.cmake forces Pytorch_CUDA FALSE (torch is the CUDA
#      build, but the extension is built as a CppExtension) and the top-level CMakeLists.txt skips
#      check_language(CUDA)/find_package(CUDAToolkit) (nvcc without a toolkit breaks them);
#      HOROVOD_GPU_* unset;
#   3. horovod/torch/CMakeLists.txt: CMAKE_CXX_STANDARD 14 -> 20 (torch 2.14 headers need C++20);
#   4. horovod/torch/CMakeLists.txt: link the torch extension with -Wl,--allow-multiple-definition
#      (gloo, built as C++14, and the C++20 torch part both define
#      gloo::rendezvous::Store::kDefaultTimeout).
set -euo pipefail

HVD_VERSION=0.28.1
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
VENV=${VENV:-$SCRIPT_DIR/../.venv}
[ -d "$VENV" ] || { echo "build-horovod: ERROR: no venv at $VENV (run 'make setup' first, or set VENV)" >&2; exit 1; }
VENV=$(cd "$VENV" && pwd)
CACHE=${CK_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cyclone_kit/wheels}
JOBS=${CK_HOROVOD_JOBS:-2}
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

say() { echo "build-horovod: $*"; }
die() { echo "build-horovod: ERROR: $*" >&2; exit 1; }

PY=$VENV/bin/python
[ -x "$PY" ] || die "no python at $PY (run 'make setup' first, or set VENV)"

if [ "$FORCE" = 0 ] && "$PY" -c "import horovod.torch" >/dev/null 2>&1; then
  say "horovod.torch already importable in $VENV; nothing to do"
  exit 0
fi

TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null) \
  || die "torch is not importable in $VENV"
PY_VERSION=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
KEY="horovod-${HVD_VERSION}_torch-${TORCH_VERSION}_py${PY_VERSION}"
KEYDIR=$CACHE/$KEY
LOG=$CACHE/$KEY.log
mkdir -p "$CACHE"

# One build at a time per cache (two `make test` runs on one machine would otherwise both build).
exec 9>"$CACHE/.$KEY.lock"
flock 9

install_cached() {
  local whl
  whl=$(ls "$KEYDIR"/horovod-*.whl 2>/dev/null | head -n1) || true
  [ -n "$whl" ] || return 1
  say "installing cached wheel $(basename "$whl")"
  # --no-deps first would miss pyyaml etc.; the deps are small pure-python packages.
  "$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$whl" >>"$LOG" 2>&1 \
    && "$PY" -m pip install -q --disable-pip-version-check "$whl" >>"$LOG" 2>&1 \
    || { tail -n 30 "$LOG" >&2; die "pip install of the cached wheel failed (log: $LOG)"; }
  "$PY" -c "import horovod.torch" >>"$LOG" 2>&1 \
    || { tail -n 30 "$LOG" >&2; die "installed the cached wheel but 'import horovod.torch' fails (log: $LOG)"; }
  say "horovod $HVD_VERSION installed into $VENV"
}

if [ "$FORCE" = 0 ] && install_cached; then
  exit 0
fi

: >"$LOG"
command -v cmake >/dev/null || die "cmake not found (need >= 3.13)"
command -v g++ >/dev/null || die "g++ not found"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/build-horovod.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
fail() {
  echo "---- last 40 lines of $LOG ----" >&2
  tail -n 40 "$LOG" >&2
  die "$* (full log: $LOG)"
}

SDIST=$CACHE/horovod-$HVD_VERSION.tar.gz
if [ ! -s "$SDIST" ]; then
  say "downloading the horovod $HVD_VERSION sdist"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "horovod==$HVD_VERSION" -d "$WORK/dl" >>"$LOG" 2>&1 || fail "pip download failed"
  mv "$WORK"/dl/horovod-"$HVD_VERSION".tar.gz "$SDIST"
fi
tar -xzf "$SDIST" -C "$WORK" || fail "cannot unpack $SDIST"
SRC=$WORK/horovod-$HVD_VERSION

say "patching the sdist for torch $TORCH_VERSION (CPU-only, C++20, allow-multiple-definition)"
"$PY" - "$SRC" >>"$LOG" 2>&1 <<'EOF' || fail "patching the sdist failed (sources changed?)"
import pathlib, sys
src = pathlib.Path(sys.argv[1])

def patch(rel, old, new):
    p = src / rel
    text = p.read_text()
    if text.count(old) != 1:
        sys.exit(f"patch: expected exactly one match in {rel} for: {old!r}")
    p.write_text(text.replace(old, new))
    print(f"patched {rel}")

# 2a. Treat the (CUDA build of) torch as CPU-only: no add_cuda(), CppExtension flags/libs.
patch("cmake/Modules/FindPytorch.cmake",
      'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n',
      'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
      'set(Pytorch_CUDA FALSE)  # cyclone_kit: CPU-only build\n')
# 2b. No CUDA language / toolkit probing (nvcc is on PATH, the toolkit is incomplete).
patch("CMakeLists.txt",
      "include(CheckLanguage)\ncheck_language(CUDA)\nif(NOT CMAKE_CUDA_COMPILER)\n",
      "include(CheckLanguage)\n# cyclone_kit: CPU-only build, CUDA detection off\n"
      "set(CMAKE_CUDA_COMPILER \"\")\nif(FALSE)\n")
# 3. torch 2.14 headers need C++20.
patch("horovod/torch/CMakeLists.txt",
      "    set(CMAKE_CXX_STANDARD 14)\n",
      "    set(CMAKE_CXX_STANDARD 20)  # cyclone_kit: torch >= 2.10 needs C++20\n")
# 4. gloo (C++14) and the C++20 torch part both define Store::kDefaultTimeout.
patch("horovod/torch/CMakeLists.txt",
      'set_target_properties(${PYTORCH_TARGET_LIB} PROPERTIES OUTPUT_NAME "mpi_lib_v2")\n',
      'set_target_properties(${PYTORCH_TARGET_LIB} PROPERTIES OUTPUT_NAME "mpi_lib_v2")\n'
      'target_link_options(${PYTORCH_TARGET_LIB} PRIVATE "-Wl,--allow-multiple-definition")  # cyclone_kit\n')
EOF

say "building the wheel (nice -n 10, -j$JOBS, ~8 min on 2 cores; log: $LOG)"
start=$(date +%s)
# Only the settings below reach the build: no GPU ops, no CUDA home, no MPI, no TF/MXNet.
(
  unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST \
        HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER HOROVOD_GPU HOROVOD_CUDA_HOME CUDA_HOME \
        HOROVOD_WITHOUT_GLOO HOROVOD_WITHOUT_PYTORCH
  export MAKEFLAGS=-j$JOBS \
         HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
         HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO
  nice -n 10 "$PY" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps \
    -w "$WORK/wheel" "$SRC"
) >>"$LOG" 2>&1 || fail "wheel build failed after $(( $(date +%s) - start )) s"

whl=$(ls "$WORK"/wheel/horovod-*.whl 2>/dev/null | head -n1)
[ -n "$whl" ] || fail "pip reported success but produced no wheel"
mkdir -p "$KEYDIR"
rm -f "$KEYDIR"/horovod-*.whl
cp "$whl" "$KEYDIR/"
say "built $(basename "$whl") in $(( $(date +%s) - start )) s; cached in $KEYDIR"
install_cached || exit 1

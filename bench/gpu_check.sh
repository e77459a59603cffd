#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU and no network (made for an H200):
#   1. the machine: nvidia-smi (driver version), nvcc, python and what it has installed;
#   2. one build of the package with the CUDA backend for sm_90 and the C++ tests in the
#      same build tree (the kernels compile once);
#   3. the C++ GPU tests: every collective on the GPU (algorithm x replicas x dtype x size
#      x op, both call styles), then the CUDA executor's own (one launch per collective,
#      back-to-back calls alternating two caller streams, misaligned buffers, more than
#      2^31 elements, 8 logical replicas) and the public CUDA API;
#   4. the Python GPU tests (tests/test_cuda.py, torch and cupy interop where installed);
#   5. the strategy layer's GPU tests (the strategy suites' real-GPU backend: -m gpu);
#   6. GPU replicas across workers: two MPI workers (mpirun, where mpi4py and Open MPI
#      are installed) sharing the GPUs, every replica checked against numpy;
#   7. the device bench, 4 KiB to 1 GiB on 2, 4 and 8 logical replicas, with the device
#      copy bandwidth and strategy.run of the same all-reduce measured in the same run.
# Every stage runs under its own time limit (together about 7 minutes) and the script
# goes on after a failure, so one run reports everything; the exit status is 0 only when
# every stage passed. A GPU is required: a test that finds none counts as failed here.
#
# Output: every log and table under $OUT when set, else under build/gpu-check/ (at most
# 8 files): gpu_check.log (this whole report), build.log, cpp-tests.log,
# python-tests.log, strategy-tests.log, multi-worker-tests.log, bench.txt (the table),
# bench.json.
#
# Nothing is downloaded (pip --no-build-isolation --no-deps). Needed beforehand: nvcc
# (CUDA 12.x or 13.x) and a driver for it, CMake >= 3.18, Ninja or make, a C++17 compiler,
# python >= 3.9 with pip, numpy, scikit-build-core >= 0.10, pybind11 >= 2.12, pytest and
# pytest-timeout; optional: ml_dtypes (bfloat16), cupy and torch with CUDA (interop),
# mpi4py and Open MPI (mpirun beside the interpreter or on PATH: stage 6).
# Hooks:
#   PYTHON=/path/to/python        the interpreter (default python3)
#   PIP_FIND_LINKS=/dir/of/wheels  wheels to install first, without network, when their
#                                 modules are missing (default: greenlet, if the package
#                                 or its tests want it); DISTVALS_GPU_CHECK_WHEELS names others
#   CUDA_ARCH=90                  the CUDA architectures to build for
#   CMAKE_BUILD_PARALLEL_LEVEL    build jobs (default: all cores)
# Usage: OUT=/some/dir bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$REPO/build/gpu-check}"
BUILD="$REPO/build/gpu-check/tree"
mkdir -p "$OUT_DIR" "$BUILD"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 8)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1
export PYTHONDONTWRITEBYTECODE=1
# A wait that hangs should fail within the stage's limit, not after the 300 s default.
export DISTVALS_TIMEOUT_SECONDS="${DISTVALS_TIMEOUT_SECONDS:-60}"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1

start=$SECONDS
failed=0
summary=()

# stage NAME LIMIT LOGFILE CMD...: runs CMD under a time limit, its output into LOGFILE
# (appended) and the last lines here; records the outcome and never stops the script.
stage() {
  local name="$1" limit="$2" log="$3" t0=$SECONDS rc
  shift 3
  printf '\n== %s (limit %s s, log %s)\n' "$name" "$limit" "${log#"$OUT_DIR"/}"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  tail -n 30 "$log"
  local took=$((SECONDS - t0)) what="ok"
  if ((rc == 124 || rc == 137)); then
    what="TIMED OUT"
  elif ((rc == 77)); then
    what="SKIPPED: no usable GPU (a failure here)"
  elif ((rc != 0)); then
    what="FAILED (exit $rc)"
  fi
  printf '== %s: %s after %s s\n' "$name" "$what" "$took"
  summary+=("$(printf '%-16s %-40s %4s s' "$name" "$what" "$took")")
  ((rc == 0)) || failed=1
  return "$rc"
}

echo "== machine"
date -u
nvidia-smi || echo "(nvidia-smi failed or is missing)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "(nvcc not on PATH; CMake may still find it)"
"$PY" - <<'PY'
import importlib, sys
print("python", sys.version.split()[0], "at", sys.executable)
for m in ("numpy", "pybind11", "scikit_build_core", "pytest", "pytest_timeout", "ml_dtypes", "cupy", "torch",
          "greenlet"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m:18} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - a report, not a check
        print(f"  {m:18} missing ({type(e).__name__})")
PY

# Wheels carried in for what this machine lacks (no network): greenlet unless told otherwise.
if [[ -n "${PIP_FIND_LINKS:-}" ]]; then
  for pkg in ${DISTVALS_GPU_CHECK_WHEELS:-greenlet}; do
    if ! "$PY" -c "import $pkg" 2>/dev/null; then
      echo "== installing $pkg from $PIP_FIND_LINKS"
      "$PY" -m pip install --no-index --find-links "$PIP_FIND_LINKS" "$pkg" || echo "(could not install $pkg)"
    fi
  done
fi

# One build: the package (the extension and libdistvals) and, in the same tree, the C++
# tests. The kernels compile once, for sm_90 only.
stage build 120 "$OUT_DIR/build.log" \
  "$PY" -m pip install --no-build-isolation --no-deps -v "$REPO" \
    -C build-dir="$BUILD" -C cmake.build-type=Release \
    -C cmake.define.DISTVALS_ENABLE_CUDA=ON \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    -C cmake.define.DISTVALS_BUILD_TESTS=ON
(cd /tmp && "$PY" -c "
import distvals
n = distvals.cuda.device_count()
print('distvals', distvals.__version__, 'has_cuda', distvals._core.has_cuda, 'CUDA devices', n,
      'runtime', distvals._core.cuda.runtime_version() if distvals._core.has_cuda else '-',
      'driver', distvals._core.cuda.driver_version() if distvals._core.has_cuda else '-')
if n == 0:
    print('no usable GPU:', distvals.cuda.unavailable_reason())
") || echo "(distvals does not import)"

# The C++ tests of the GPU, one after another; exit status 77 (no usable GPU) fails here.
export DISTVALS_TESTS_DIR="$BUILD/cpp/tests"
stage cpp-tests 90 "$OUT_DIR/cpp-tests.log" bash -c '
  rc=0
  for t in "test_cuda_api" "test_collectives cuda" "test_cuda_executor cuda"; do
    echo "-- $t"
    "$DISTVALS_TESTS_DIR"/$t || { s=$?; echo "-- $t: exit $s"; rc=$s; }
  done
  exit $rc'

stage python-tests 60 "$OUT_DIR/python-tests.log" \
  env DISTVALS_REQUIRE_GPU=1 "$PY" -m pytest "$REPO/tests/test_cuda.py" -q -ra --timeout 60 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO"

stage strategy-tests 45 "$OUT_DIR/strategy-tests.log" \
  "$PY" -m pytest "$REPO/tests/test_strategy_backends.py" "$REPO/tests/test_strategy_api_backends.py" \
    -m gpu -q -ra --timeout 30 -c "$REPO/pyproject.toml" --rootdir "$REPO"

# Open MPI refuses to run as root unless told; such machines often run commands as root.
stage multi-worker 90 "$OUT_DIR/multi-worker-tests.log" \
  env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  "$PY" -m pytest "$REPO/tests/test_multi_worker.py" -m gpu -q -ra --timeout 80 --durations 3 \
    -c "$REPO/pyproject.toml" --rootdir "$REPO"

stage bench 80 "$OUT_DIR/bench.txt" \
  "$PY" -m distvals.bench.gpu --replicas 2,4,8 --min 4K --max 1G --budget-seconds 65 --json "$OUT_DIR/bench.json"

printf '\n== summary (%s s in all; logs in %s)\n' "$((SECONDS - start))" "$OUT_DIR"
printf '  %s\n' "${summary[@]}"
exit "$failed"

#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and no network, build distvals with the
# CUDA backend, run the GPU tests, then the GPU all-reduce benchmark on 2, 4 and 8
# logical replicas of one GPU, 4 KiB to 1 GiB. Finishes in under 5 minutes: every
# stage runs under its own time limit (120 + 60 + 100 s at most).
#
# Nothing is downloaded (pip install --no-build-isolation --no-deps), so these must be
# installed beforehand:
#   - a CUDA toolkit with nvcc (12.x or 13.x) and an NVIDIA driver for it;
#   - CMake >= 3.18, Ninja (or make), a C++17 compiler;
#   - Python >= 3.9 with pip, numpy, scikit-build-core >= 0.10, pybind11 >= 2.12,
#     pytest and pytest-timeout;
#   - optional: ml_dtypes (bfloat16 tests), cupy (the benchmark's peer column),
#     torch with CUDA (interop test).
# Usage: bash bench/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

echo "== machine"
nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "(nvcc not on PATH; CMake may still find it)"

echo "== build with DISTVALS_ENABLE_CUDA=ON"
timeout 120 "$PY" -m pip install --no-build-isolation --no-deps -q . \
  -C cmake.define.DISTVALS_ENABLE_CUDA=ON -C build-dir=build/gpu-check
echo "built in $((SECONDS - start)) s"
(cd /tmp && "$PY" -c "
import distvals
n = distvals.cuda.device_count()
print('distvals', distvals.__version__, 'has_cuda', distvals._core.has_cuda, 'CUDA devices', n)
assert n > 0, 'no CUDA device: ' + distvals.cuda.unavailable_reason()
")

echo "== GPU tests"
DISTVALS_REQUIRE_GPU=1 timeout 60 "$PY" -m pytest tests/test_cuda.py -q -x --timeout 50
echo "== GPU replicas in the strategy layer"
timeout 60 "$PY" -m pytest tests/test_gpu_strategy.py -m gpu -q -x --timeout 50

echo "== GPU bench"
timeout 100 "$PY" -m distvals.bench.gpu --replicas 2,4,8 --min 4K --max 1G --budget-seconds 80

echo "== done in $((SECONDS - start)) s"

#!/usr/bin/env bash
# The C++ engine and its tests under the sanitizers and valgrind:
#   asan        AddressSanitizer + UndefinedBehaviorSanitizer (DISTVALS_SANITIZE=address,undefined)
#   tsan        ThreadSanitizer (DISTVALS_SANITIZE=thread); with the CUDA executor's tests on
#               the host model of the CUDA runtime (test_collectives model,
#               test_cuda_executor model), whose streams are threads: an ordering bug in
#               the executor is a data race here
#   memcheck    valgrind memcheck over a plain optimized build (skipped without valgrind)
# each built into its own folder under _build/ and run through ctest, and
#   python-asan the Python package built with address,undefined into its own venv, and
#               the engine-facing Python tests run with the sanitizer runtime preloaded
#               (CPython itself is not instrumented; the engine and bindings are)
# Any sanitizer report or memcheck error fails the script.
#
# Usage: .ci/sanitizers.sh [asan] [tsan] [memcheck] [python-asan]   (none: all four)
# Environment:
#   PYTHON                interpreter for the python-asan venv (default: python3); that
#                         step installs the package's build and test requirements with pip
#   DISTVALS_TEST_QUICK   1 (default here): the tests run their reduced matrix; set 0 for
#                         the full one (about 4 minutes under ThreadSanitizer on 2 cores)
#   DISTVALS_BUILD_ROOT   where the build folders go (default: <repo>/_build)
#   DISTVALS_MEMCHECK_BUILD  a configured and built folder of the C++ tests without
#                         sanitizers for memcheck to use (default: it builds its own)
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: number of cores)
# Needs cmake, ninja and a GCC or Clang with the sanitizer runtimes, all from PATH.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_root="${DISTVALS_BUILD_ROOT:-$root/_build}"
export DISTVALS_TEST_QUICK="${DISTVALS_TEST_QUICK:-1}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
# The engine's own default timeout is 300 s; a hang should fail much sooner here.
export DISTVALS_TIMEOUT_SECONDS="${DISTVALS_TIMEOUT_SECONDS:-120}"

# Reports stop the test at once, with a stack, and leave a non-zero exit status.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:exitcode=66}"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(asan tsan memcheck python-asan)

log() { printf '\n== %s ==\n' "$*"; }

configure_build() {  # <folder> <cmake args...>
  local dir="$1"
  shift
  cmake -S "$root" -B "$dir" -G Ninja \
    -DDISTVALS_BUILD_PYTHON=OFF -DDISTVALS_ENABLE_CUDA=OFF -DDISTVALS_BUILD_BENCH=OFF \
    -DDISTVALS_BUILD_TESTS=ON "$@" >/dev/null
  cmake --build "$dir"
}

run_ctest() {  # <folder>
  ctest --test-dir "$1" --output-on-failure --timeout 900
}

sanitizer() {  # <name> <DISTVALS_SANITIZE value>
  local name="$1" what="$2" dir="$build_root/$1"
  log "$name: DISTVALS_SANITIZE=$what (DISTVALS_TEST_QUICK=$DISTVALS_TEST_QUICK)"
  local t0=$SECONDS
  configure_build "$dir" -DCMAKE_BUILD_TYPE= -DDISTVALS_SANITIZE="$what"
  local out="$dir/ctest.log" status=0
  run_ctest "$dir" 2>&1 | tee "$out" || status=$?
  if [ "$status" -ne 0 ] && grep -q "unexpected memory mapping" "$out"; then
    # ThreadSanitizer cannot map its shadow memory with some kernels' address-space
    # randomization; it works with randomization off for the test processes.
    log "$name: retrying with address-space randomization off"
    status=0
    setarch "$(uname -m)" -R ctest --test-dir "$dir" --output-on-failure --timeout 900 || status=$?
  fi
  log "$name: exit status $status after $((SECONDS - t0)) s"
  return "$status"
}

memcheck() {
  if ! command -v valgrind >/dev/null 2>&1; then
    log "memcheck: valgrind not found, skipped"
    return 0
  fi
  local dir="${DISTVALS_MEMCHECK_BUILD:-$build_root/memcheck}" t0=$SECONDS status=0
  log "memcheck: valgrind over the C++ tests in $dir (DISTVALS_TEST_QUICK=$DISTVALS_TEST_QUICK)"
  # A build of the C++ tests without sanitizers may be handed over (CI reuses its own, which
  # saves a build); otherwise one with debug information is made here.
  [ -n "${DISTVALS_MEMCHECK_BUILD:-}" ] || configure_build "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDISTVALS_SANITIZE=
  # Valgrind runs one thread at a time, so the tests get their quick matrix always.
  # Leaks are errors only when definite: thread-local and static runtime buffers are
  # "still reachable" by design.
  local vg=(valgrind --tool=memcheck --error-exitcode=97 --leak-check=full
            --errors-for-leak-kinds=definite --show-leak-kinds=definite --track-origins=no
            --fair-sched=yes --quiet)
  local t
  # The collective matrix on the host model of CUDA runs under ASan and TSan; under
  # valgrind, which runs one thread at a time, its stream threads take three minutes, so
  # memcheck keeps the CUDA executor's own tests on the model and the CPU matrix.
  for t in "test_schedule" "test_errors" "test_faults" "test_collectives cpu" "test_cuda_executor model"; do
    local exe="$dir/cpp/tests/${t%% *}" args=""
    [[ "$t" == *" "* ]] && args="${t#* }"
    [ -x "$exe" ] || continue
    printf -- '-- valgrind %s\n' "$t"
    # shellcheck disable=SC2086
    DISTVALS_TEST_QUICK=1 timeout 900 "${vg[@]}" "$exe" $args || { status=$?; printf 'FAILED: %s (exit %s)\n' "$t" "$status"; }
  done
  log "memcheck: exit status $status after $((SECONDS - t0)) s"
  return "$status"
}

python_asan() {
  local dir="$build_root/python-asan" t0=$SECONDS status=0
  local py="${PYTHON:-python3}" venv="$build_root/python-asan/venv"
  log "python-asan: the package built with DISTVALS_SANITIZE=address,undefined, engine-facing pytest"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$root[test]" -C build-dir="$dir/build" \
    -C cmake.define.DISTVALS_ENABLE_CUDA=OFF -C cmake.define.DISTVALS_SANITIZE=address,undefined \
    -C cmake.build-type=RelWithDebInfo
  # The sanitizer runtime must come first in the process; libstdc++ is preloaded too so
  # that AddressSanitizer finds the real __cxa_throw (python itself does not link it).
  local cxx="${CXX:-g++}"
  local preload
  preload="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libstdc++.so)"
  # The engine-facing tests: every ReplicaGroup test file, the one-call all-reduce of a
  # structure's leaves and the inline replicas' meetings (copies and array views made in
  # the bindings), their scheduler loop and nest's walks (Python objects handled in C),
  # and the strategy layer's calls into the engine (variables and datasets add Python
  # logic over them).
  local tests=() t
  for t in "$root"/tests/test_group_*.py; do
    [ -f "$t" ] && tests+=("tests/$(basename "$t")")
  done
  for t in test_all_reduce_leaves test_quick_all_reduce test_inline_scheduler test_nest test_strategy_failures test_strategy test_context; do
    [ -f "$root/tests/$t.py" ] || { echo "python-asan: tests/$t.py is missing" >&2; return 1; }
    tests+=("tests/$t.py")
  done
  # Leaks are not checked: CPython keeps much of its memory until exit by design.
  (cd "$root" && LD_PRELOAD="$preload" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
    "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "${tests[@]}") || status=$?
  log "python-asan: exit status $status after $((SECONDS - t0)) s"
  return "$status"
}

failed=0
for s in "${steps[@]}"; do
  case "$s" in
    asan) sanitizer asan address,undefined || failed=1 ;;
    tsan) sanitizer tsan thread || failed=1 ;;
    memcheck) memcheck || failed=1 ;;
    python-asan) python_asan || failed=1 ;;
    *) echo "unknown step '$s' (expected asan, tsan, memcheck or python-asan)" >&2; exit 2 ;;
  esac
done
exit "$failed"

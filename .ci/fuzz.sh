#!/usr/bin/env bash
# Fuzzes the input checks of ReplicaGroup's collectives (tests/fuzz/fuzz_group.py) for a
# bounded time, with atheris (coverage-guided, installed with pip when missing) or, where
# atheris cannot be installed, with pseudo-random inputs. Any failure exits non-zero and
# leaves the failing input under the artifacts folder.
#
# Usage: .ci/fuzz.sh [seconds]          (default 60, or DISTVALS_FUZZ_SECONDS)
# Environment:
#   PYTHON                   interpreter with distvals installed (default: python3)
#   DISTVALS_FUZZ_ARTIFACTS  where failing inputs go (default: <repo>/_build/fuzz)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-${DISTVALS_FUZZ_SECONDS:-60}}"
py="${PYTHON:-python3}"
artifacts="${DISTVALS_FUZZ_ARTIFACTS:-$root/_build/fuzz}"
mkdir -p "$artifacts"
target="$root/tests/fuzz/fuzz_group.py"

if ! "$py" -c "import atheris" >/dev/null 2>&1; then
  "$py" -m pip install -q atheris >/dev/null 2>&1 || echo "fuzz: could not install atheris"
fi

start=$SECONDS
if "$py" -c "import atheris" >/dev/null 2>&1; then
  echo "fuzz: atheris, ${seconds} s"
  # -timeout: one input may take this long (a hang); -rss_limit_mb: memory per process.
  (cd "$artifacts" && "$py" "$target" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 \
    -artifact_prefix="$artifacts/" -print_final_stats=1)
else
  echo "fuzz: atheris unavailable, pseudo-random inputs for ${seconds} s"
  "$py" "$target" --random 1000000000 --seconds "$seconds" --seed "${DISTVALS_FUZZ_SEED:-$RANDOM}"
fi
echo "fuzz: passed after $((SECONDS - start)) s"

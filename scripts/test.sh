#!/usr/bin/env bash
# The whole test suite: the C/C++ formatting check, C++ tests (GoogleTest, built with ASan+UBSan),
# fuzzing, the docs site in strict mode, the Python tests (examples included), then a clean-venv
# install from the sdist.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
source scripts/ccache_env.sh

echo "== Format (clang-format, the version scripts/format.sh pins: a file it would change fails)"
bash scripts/format.sh --check

echo "== C++ tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B build/asan -G Ninja -DRUMOR_BUILD_PYTHON=OFF -DRUMOR_BUILD_TESTS=ON -DRUMOR_WERROR=ON \
  -DRUMOR_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/asan
ctest --test-dir build/asan --output-on-failure -j 2 --timeout 180

# The fake libnccl (tests/cpp/fake_nccl.cpp) once more, without sanitizers: the Python tests load
# it into a plain interpreter (tests/python/test_nccl.py, test_gpu_watch.py).
mkdir -p build/fake-nccl
${CXX:-g++} -std=c++20 -O1 -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror -pthread \
  tests/cpp/fake_nccl.cpp -o build/fake-nccl/libnccl-fake.so
export RUMOR_FAKE_NCCL="$PWD/build/fake-nccl/libnccl-fake.so"

echo "== Fuzzing (a short run of every target; scripts/fuzz.sh runs them for 10 minutes each)"
bash scripts/fuzz.sh "${RUMOR_CI_FUZZ_SECONDS:-15}"

echo "== Docs site (MkDocs, strict: a broken link or a missing name fails)"
bash scripts/docs.sh

echo "== Python tests"
# Tests marked slow (more ddp_cnn algorithms, elastic churn, Ray Train: another launch each, with nothing a
# faster test leaves unchecked) run with RUMOR_TEST_SLOW=1; CI leaves them out to stay in time.
# Two workers (pytest-xdist), a test module each at a time (loadfile keeps a module's launch batches
# in one process): much of a test's time is waiting (process starts, deadlines, a peer's death
# noticed), which the other worker fills. Modules go out longest first (tests/python/conftest.py, from
# tests/python/module_times.json), so no long module starts last while the other worker has nothing
# left. RUMOR_TEST_WORKERS=0 runs them in this process, one by one. -rs: the log says why each
# skipped test was skipped (no GPU, no etcd, ...), so a test that stopped running shows.
WORKERS=${RUMOR_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then PAR=(); else PAR=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
if [ "${RUMOR_TEST_SLOW:-0}" = 1 ]; then
  $PY -m pytest tests/python -q -p no:cacheprovider "${PAR[@]}" -rs --durations=30
else
  $PY -m pytest tests/python -q -p no:cacheprovider "${PAR[@]}" -m "not slow" -rs --durations=30
fi

echo "== Install check (sdist -> wheel -> fresh venv -> import rumor and a 2-rank allreduce)"
bash scripts/check_install.sh

if [ -n "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ]; then
  echo "== ccache (scripts/ccache_env.sh)"
  ccache --show-stats 2>/dev/null | grep -iE "^ *(hits|misses|cacheable)" || true
fi

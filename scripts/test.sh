#!/usr/bin/env bash
# The whole test suite: C++ tests (GoogleTest, built with ASan+UBSan) then the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}

echo "== C++ tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B build/asan -G Ninja -DRUMOR_BUILD_PYTHON=OFF -DRUMOR_BUILD_TESTS=ON \
  -DRUMOR_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/asan
ctest --test-dir build/asan --output-on-failure -j 2 --timeout 180

echo "== Python tests"
$PY -m pytest tests/python -q -p no:cacheprovider

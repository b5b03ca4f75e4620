#!/usr/bin/env bash
# C++ tests under a sanitizer: `scripts/sanitize.sh thread` (TSan) or `scripts/sanitize.sh`
# (ASan+UBSan, which scripts/test.sh also runs).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-address,undefined}
dir=build/san-${kind//,/-}
cmake -S . -B "$dir" -G Ninja -DRUMOR_BUILD_PYTHON=OFF -DRUMOR_BUILD_TESTS=ON -DRUMOR_WERROR=ON \
  -DRUMOR_SANITIZE="$kind" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$dir"
ctest --test-dir "$dir" --output-on-failure -j 2 --timeout 300

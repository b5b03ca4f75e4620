#!/usr/bin/env bash
# Builds, on a machine without a GPU, what a short GPU loan needs, into .gpu-carry/ (ignored by git;
# name it in the device tool's `carry`):
#   - rumor's wheel with its CUDA kernels for the GPU machine's Python (3.12 by default; sm_90),
#   - the C++ test binary with the CUDA tests (stripped),
#   - run.sh: the GPU check with both (scripts/gpu_check.sh), then scripts/debug/gpu_call_profile.py.
# The GPU machine then only installs and runs: about 4 minutes instead of building for several.
#
#   bash scripts/gpu_prepare.sh            # then, on the device: bash .gpu-carry/run.sh
#
# Needs nvcc and a Python of the GPU machine's version (GPU_PYTHON, default python3.12, e.g. from pyenv)
# with scikit-build-core, pybind11, cmake and ninja (installed into it here if missing; pip's index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3.12}
ARCH=${CUDAARCHS:-90}
CARRY=.gpu-carry
grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >>"$(git rev-parse --git-path info/exclude)"
mkdir -p "$CARRY"

echo "== C++ tests with CUDA (build/gpu-tests, sm_$ARCH)"
CUDAARCHS=$ARCH cmake -S . -B build/gpu-tests -G Ninja -DRUMOR_BUILD_PYTHON=OFF -DRUMOR_BUILD_TESTS=ON -DRUMOR_CUDA=ON \
  -DRUMOR_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/gpu-tests --target rumor_tests
strip -o "$CARRY/rumor_tests" build/gpu-tests/tests/cpp/rumor_tests

echo "== wheel for $($PY --version) with CUDA kernels"
"$PY" -c "import scikit_build_core, pybind11, cmake, ninja" 2>/dev/null ||
  "$PY" -m pip install -q scikit-build-core pybind11 cmake ninja
rm -f "$CARRY"/rumor-*.whl
CUDAARCHS=$ARCH "$PY" -m pip wheel . --no-deps --no-build-isolation -w "$CARRY" -C cmake.define.RUMOR_CUDA=ON \
  -C cmake.define.RUMOR_WERROR=ON -C build-dir="${GPU_WHEEL_BUILD_DIR:-build/gpu-wheel-$ARCH}" >build/gpu-prepare-wheel.log 2>&1 ||
  { tail -40 build/gpu-prepare-wheel.log; exit 1; }

cat >"$CARRY/run.sh" <<'RUN'
#!/bin/bash
# Made by scripts/gpu_prepare.sh: the GPU check with the carried wheel and test binary, then the call and
# DDP profile. Env: CHECK_LIMIT, PROFILE_LIMIT (seconds), NO_PROFILE=1, PROFILE_ARGS, and gpu_check.sh's own.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/gpu-out}; mkdir -p "$O" /tmp/gc /tmp/prof
export RUMOR_GPU_WHEEL=$(ls "$PWD"/.gpu-carry/rumor-*.whl) RUMOR_GPU_TESTS_BIN=$PWD/.gpu-carry/rumor_tests
export GPU_PYTEST_TIMEOUT=${GPU_PYTEST_TIMEOUT:-180} GPU_PLUGIN_TIMEOUT=${GPU_PLUGIN_TIMEOUT:-60}
export GPU_CODECS_TIMEOUT=${GPU_CODECS_TIMEOUT:-60} GPU_BENCH_ARGS=${GPU_BENCH_ARGS:-"--quick --time-limit 80"}
T0=$SECONDS
OUT=/tmp/gc timeout "${CHECK_LIMIT:-330}" bash scripts/gpu_check.sh >"$O/gpu_check.txt" 2>&1
echo "gpu_check rc=$? after $((SECONDS - T0)) s" | tee -a "$O/gpu_check.txt"
grep -A12 "=== summary" "$O/gpu_check.txt"
tar czf "$O/gc.tgz" -C /tmp/gc . 2>/dev/null  # the device tool brings back at most 8 files
if [ -z "${NO_PROFILE:-}" ]; then
  timeout "${PROFILE_LIMIT:-150}" python3 scripts/debug/gpu_call_profile.py --out /tmp/prof ${PROFILE_ARGS:-} \
    >"$O/profile.txt" 2>&1
  echo "profile rc=$? after $((SECONDS - T0)) s" | tee -a "$O/profile.txt"
  sed -n '/== one-element/,/^$/p' "$O/profile.txt"
  grep "== DDP" "$O/profile.txt"
  cat /tmp/prof/trace_*.json 2>/dev/null | gzip >"$O/trace.json.gz"
  cp /tmp/prof/gpu_call_profile.json "$O/" 2>/dev/null
fi
echo "total $((SECONDS - T0)) s"
RUN
chmod +x "$CARRY/run.sh"
ls -la "$CARRY"
echo "carry: $CARRY   command: GPU_CHECK_SKIP=nccl_plugin CHECK_LIMIT=225 PROFILE_LIMIT=90 bash $CARRY/run.sh"

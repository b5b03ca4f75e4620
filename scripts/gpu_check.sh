#!/usr/bin/env bash
# The GPU check, one command on a machine with a GPU and nvcc, from the repository root:
#
#   bash scripts/gpu_check.sh
#
# builds and installs rumor with its CUDA kernels (pip, --no-build-isolation --no-deps: no
# network needed), builds and runs the C++ CUDA tests, runs the Python CUDA tests (codecs, CUDA
# tensors in the collectives over host staging and NCCL, DDP and windows on CUDA), reruns the
# killed-peer test with native backtraces (scripts/debug/), runs real NCCL through the net plugin
# (benchmarks/nccl_netplugin.py), measures the
# CUDA codecs (benchmarks/codecs.py --device cuda) and runs benchmarks/gpu.py (allreduce and DDP
# training, rumor vs torch.distributed on the one GPU, --time-limit 420 s by default;
# GPU_BENCH_ARGS=--quick for a short run). With RUMOR_EXPECT_GPU=1 (set here) the tests and the
# GPU benchmark fail rather than skip when the GPU or the CUDA build is missing. Logs and the
# benchmarks' JSON and PNG go to $OUT when set (the device machine's output folder), else to
# build/gpu-check. GPU_PYTEST_TIMEOUT, GPU_PLUGIN_TIMEOUT and GPU_CODECS_TIMEOUT bound those steps
# (seconds) where the machine is lent for a short time; GPU_CHECK_SKIP="nccl_plugin benchmark" leaves out
# those steps (by function name: install cpp_tests python_tests crash_probe nccl_plugin benchmark
# gpu_benchmark), listed as skipped in the summary. Every step runs even if an earlier one failed; the summary at the end lists
# each, and the exit status is 1 if any failed.
#
# To spend less time on the GPU machine, build what does not need it elsewhere and point at it:
#   RUMOR_GPU_TESTS_BIN=path/to/rumor_tests   a CUDA build of the C++ tests (-DRUMOR_CUDA=ON), run as is
#   RUMOR_GPU_WHEEL=path/to/rumor-*.whl        a CUDA wheel for this Python, installed instead of building
# A wheel built here is copied to $OUT (GPU_CHECK_KEEP_WHEEL=1) for the next run to reuse. CUDA code is
# compiled for the GPU present (CUDAARCHS=native) unless CUDAARCHS says otherwise.
#
# Where the GPU machine lacks pytest or GoogleTest, prepare them here first (needs pip's index):
#   bash scripts/gpu_check.sh --prepare
# which fills build/gpu-deps (pytest for Python >= 3.10, GoogleTest's sources); carry that path.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEPS=build/gpu-deps
mkdir -p build  # a fresh checkout on the GPU machine has none (it is ignored, so not carried)
OUT_DIR=${OUT:-build/gpu-check}
JOBS=${JOBS:-$(nproc)}

if [ "${1:-}" = "--prepare" ]; then
  rm -rf "$DEPS"
  mkdir -p "$DEPS"
  # Pure-Python wheels, with the backports Python 3.10 needs (harmless on later versions).
  "$PY" -m pip install -q --target "$DEPS/py" --python-version 3.10 --only-binary=:all: pytest exceptiongroup tomli tqdm \
    typing_extensions
  if [ -d /usr/src/googletest ]; then
    cp -r /usr/src/googletest "$DEPS/googletest-src"
  else
    echo "gpu_check --prepare: no /usr/src/googletest here (apt-get install libgtest-dev)" >&2
  fi
  du -sh "$DEPS"
  echo "carry: $DEPS"
  exit 0
fi

mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1

show() {
  echo "+ $*"
  "$@"
}

results=()
failed=0
# step NAME COMMAND...: runs it, records ok / FAILED, never stops the script.
step() {
  local name=$1
  shift
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $1 "* ]]; then
    results+=("skipped $name")
    return
  fi
  echo
  echo "=== $name"
  local t0=$SECONDS
  if "$@"; then
    results+=("ok      $name ($((SECONDS - t0)) s)")
  else
    results+=("FAILED  $name ($((SECONDS - t0)) s)")
    failed=1
  fi
}

# nvcc off PATH is still used where the toolkit sits in its usual place.
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
[ -d "$DEPS/py" ] && export PYTHONPATH="$PWD/$DEPS/py${PYTHONPATH:+:$PYTHONPATH}"
export RUMOR_EXPECT_GPU=1
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
command -v nvidia-smi >/dev/null 2>&1 && export CUDAARCHS=${CUDAARCHS:-native}

environment() {
  command -v nvidia-smi >/dev/null 2>&1 && show nvidia-smi -L
  show "${CUDACXX:-nvcc}" --version
  show "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
    'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  # The build uses this machine's own pybind11 and scikit-build-core (--no-build-isolation).
  "$PY" -m pip list 2>/dev/null | grep -iE "^(pybind11|scikit.build.core|cmake|ninja|numpy) " || true
  show cc --version
  for m in pytest numpy hypothesis matplotlib tqdm; do
    "$PY" -c "import $m" 2>/dev/null && echo "python module $m: yes" || echo "python module $m: MISSING"
  done
}

install() {
  local wheel=${RUMOR_GPU_WHEEL:-}
  if [ -z "$wheel" ]; then
    rm -rf build/gpu-wheel-out
    show "$PY" -m pip wheel --no-build-isolation --no-deps -C cmake.define.RUMOR_CUDA=ON -C cmake.define.RUMOR_WERROR=ON \
      -C build-dir=build/gpu-wheel -w build/gpu-wheel-out . >build/gpu-pip-wheel.log 2>&1 ||
      { tail -40 build/gpu-pip-wheel.log; return 1; }
    wheel=$(ls build/gpu-wheel-out/rumor-*.whl)
    [ "${GPU_CHECK_KEEP_WHEEL:-0}" = 1 ] && cp "$wheel" "$OUT_DIR/"
  fi
  local args=(-m pip install --no-deps --force-reinstall "$wheel")
  if ! show "$PY" "${args[@]}" >build/gpu-pip.log 2>&1; then
    # A distribution's Python may refuse to install into itself (PEP 668).
    grep -q externally-managed build/gpu-pip.log || { cat build/gpu-pip.log; return 1; }
    show "$PY" "${args[@]}" --break-system-packages
  fi
  show "$PY" -c "import rumor._C as c, rumor.compression as C
print('rumor: cuda built', c.cuda_built(), 'devices', c.cuda_device_count())
assert C.cuda_available(), 'rumor cannot use the GPU'"
}

cpp_tests() {
  if [ -n "${RUMOR_GPU_TESTS_BIN:-}" ]; then
    show "$RUMOR_GPU_TESTS_BIN" --gtest_filter='Cuda*'
    return
  fi
  local dir=build/gpu-tests
  # RelWithDebInfo as scripts/test.sh: GCC 12 at -O3 raises a false -Wrestrict in tests/cpp/ranks.h.
  local cfg=(-S . -B "$dir" -G Ninja -DRUMOR_BUILD_PYTHON=OFF -DRUMOR_BUILD_TESTS=ON -DRUMOR_CUDA=ON -DRUMOR_WERROR=ON
    -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  if ! show cmake "${cfg[@]}" >"$OUT_DIR/cmake.log" 2>&1; then
    grep -q GTest "$OUT_DIR/cmake.log" && [ -d "$DEPS/googletest-src" ] || { cat "$OUT_DIR/cmake.log"; return 1; }
    # No GoogleTest here: build the carried sources (scripts/gpu_check.sh --prepare).
    local prefix=$PWD/build/gpu-gtest/prefix
    show cmake -S "$DEPS/googletest-src" -B build/gpu-gtest -G Ninja -DCMAKE_INSTALL_PREFIX="$prefix" -DBUILD_GMOCK=OFF \
      -Wno-deprecated >/dev/null
    show cmake --build build/gpu-gtest --target install >/dev/null
    show cmake "${cfg[@]}" -DCMAKE_PREFIX_PATH="$prefix" >"$OUT_DIR/cmake.log" 2>&1 ||
      { cat "$OUT_DIR/cmake.log"; return 1; }
  fi
  grep "rumor:" "$OUT_DIR/cmake.log" || true
  show cmake --build "$dir" --target rumor_tests
  show "$dir/tests/cpp/rumor_tests" --gtest_filter='Cuda*'
}

python_tests() {
  # Only what needs the GPU: the CPU-only cases of these files run in CI.
  # test_cuda_collectives.py: CUDA tensors in the collectives, host staging (2 ranks on one GPU)
  # and NCCL (a 1-rank group); it loads the real libnccl (RUMOR_NCCL_LIBRARY or torch's wheel).
  # test_ddp_device.py: DistributedDataParallel on a CUDA model, every algorithm, against the
  # CPU, and against torch's DDP; test_window.py: staged windows of CUDA tensors; test_nccl.py: the real libnccl;
  # test_torch_backend_cuda.py: CUDA tensors on torch.distributed's "rumor" backend (staged, and its NCCL map).
  local files=(tests/python/test_cuda_codecs.py tests/python/test_cuda_collectives.py tests/python/test_nccl.py
    tests/python/test_torch_backend_cuda.py
    tests/python/test_ddp_device.py::test_cuda_model_matches_cpu tests/python/test_ddp_device.py::test_cuda_model_matches_torch_ddp
    tests/python/test_ddp_device.py::test_cuda_buckets_overlap_backward
    tests/python/test_window.py::test_windows_of_cuda_tensors)
  local par=()
  "$PY" -c "import xdist" 2>/dev/null && par=(-n "${GPU_TEST_WORKERS:-4}")
  local rc=0
  show timeout "${GPU_PYTEST_TIMEOUT:-1200}" "$PY" -m pytest "${files[@]}" "${par[@]}" -q -p no:cacheprovider -rsP --tb=short || rc=1
  # test_compression.py also checks how CPU codecs treat CUDA tensors; it needs hypothesis.
  if "$PY" -c "import hypothesis" 2>/dev/null; then
    show "$PY" -m pytest tests/python/test_compression.py -k "cuda or device" -q -p no:cacheprovider -rs \
      --tb=short || rc=1
  fi
  return $rc
}

benchmark() {
  show timeout "${GPU_CODECS_TIMEOUT:-600}" "$PY" benchmarks/codecs.py --device cuda --out "$OUT_DIR/codecs_cuda.json"
}

gpu_benchmark() {
  # allreduce: 1 rank over NCCL (rumor vs torch nccl), 2 ranks sharing the GPU over host staging
  # (rumor vs torch gloo); DDP training of the standard models vs torch DDP; it bounds itself
  # with --time-limit (420 s by default); GPU_BENCH_ARGS=--quick for a short run.
  show "$PY" benchmarks/gpu.py ${GPU_BENCH_ARGS:-} --out "$OUT_DIR/gpu.json"
}

crash_probe() {
  # A rank whose peer exited segfaulted in its next allreduce on the GPU machine (a statically
  # linked libstdc++ whose symbols the extension exported; docs/gpu.md): the test and a plain
  # repro without faulthandler, with native backtraces (scripts/debug/), printed whole.
  rm -f /tmp/segv-*.txt
  cc -shared -fPIC -O1 -o /tmp/rumor-segv.so scripts/debug/segv_backtrace.c || return 1
  local rc=0
  show env LD_PRELOAD=/tmp/rumor-segv.so timeout 120 "$PY" -m pytest -q -p no:cacheprovider --tb=line \
    tests/python/test_cuda_collectives.py -k killed_peer || rc=1
  for _ in 1 2 3; do
    show env LD_PRELOAD=/tmp/rumor-segv.so timeout 90 "$PY" scripts/debug/peer_exit.py || rc=1
  done
  "$PY" scripts/debug/segv_report.py
  return $rc
}

nccl_plugin() {
  # Real NCCL through libnccl-net-rumor.so: two ranks as two NCCL hosts on the one GPU.
  show timeout "${GPU_PLUGIN_TIMEOUT:-900}" "$PY" benchmarks/nccl_netplugin.py ${GPU_PLUGIN_ARGS:-} --out "$OUT_DIR/nccl_netplugin.json"
}

step "environment" environment
step "pip install (CUDA kernels required)" install
step "C++ CUDA tests" cpp_tests
step "Python CUDA tests" python_tests
step "a peer that exits (native backtraces on a crash)" crash_probe
step "NCCL through the net plugin" nccl_plugin
step "CUDA codec benchmark" benchmark
step "GPU benchmark (allreduce, DDP)" gpu_benchmark

echo
echo "=== summary (logs in $OUT_DIR)"
printf '%s\n' "${results[@]}"
exit $failed

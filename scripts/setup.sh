#!/usr/bin/env bash
# Installs what rumor needs on a fresh Debian machine (apt and pip packages) and builds and
# installs rumor itself. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_pkgs=()
command -v ip >/dev/null 2>&1 || apt_pkgs+=(iproute2)
command -v tc >/dev/null 2>&1 || apt_pkgs+=(iproute2)
[ -f /usr/include/gtest/gtest.h ] || apt_pkgs+=(libgtest-dev)
[ -f /usr/include/openssl/hmac.h ] || apt_pkgs+=(libssl-dev)  # libcrypto: the connection handshake's HMAC
command -v g++ >/dev/null 2>&1 || apt_pkgs+=(g++)
command -v ccache >/dev/null 2>&1 || apt_pkgs+=(ccache)  # compiler cache: scripts/ccache_env.sh
command -v redis-server >/dev/null 2>&1 || apt_pkgs+=(redis-server)  # rumor.data cache; rumor starts its own
# rumor-run --live --store etcd: the launchers start their own members (etcd), etcdctl to look inside
command -v etcd >/dev/null 2>&1 || apt_pkgs+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || apt_pkgs+=(etcd-client)
# The fuzz targets (scripts/fuzz.sh): clang's libFuzzer with ASan+UBSan.
command -v clang++-14 >/dev/null 2>&1 || apt_pkgs+=(clang-14)
compgen -G "/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null || apt_pkgs+=(libfuzzer-14-dev)
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  echo "setup: apt-get install ${apt_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # No system redis or etcd service: a policy-rc.d (unless one exists) stops the packages from starting them.
  rc_policy=""; [ -e /usr/sbin/policy-rc.d ] || { rc_policy=/usr/sbin/policy-rc.d; printf '#!/bin/sh\nexit 101\n' >"$rc_policy"; chmod +x "$rc_policy"; }
  apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
  [ -z "$rc_policy" ] || rm -f "$rc_policy"
  for svc in redis-server etcd; do
    if [ -d /run/systemd/system ] && systemctl list-unit-files "$svc.service" >/dev/null 2>&1; then
      systemctl disable --now "$svc" >/dev/null 2>&1 || true
    fi
  done
fi

PY=${PYTHON:-python3}
# The package asks for torch >= 2.1; 2.13.0 (this machine's CPU build) is the version CI tests.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
# networkx: rumor.topology; redis: rumor.data's cache client (redis-py); ipyparallel, nbclient,
# nbformat, ipykernel: rumor.interactive; optuna: the autotuner; matplotlib, tqdm: benchmarks/;
# build: scripts/check_install.sh; mkdocs*: the documentation site; atheris: scripts/fuzz.sh;
# clang-format, pinned: scripts/format.sh (another version formats the same config differently);
# pytest-xdist: scripts/test.sh runs the Python tests on two workers.
$PY -m pip install -q "scikit-build-core>=0.11" "pybind11>=2.12" cmake ninja numpy pytest pytest-xdist hypothesis matplotlib \
  networkx tqdm build redis "ipyparallel>=8" nbclient nbformat ipykernel optuna atheris \
  mkdocs mkdocs-material "mkdocstrings[python]" "clang-format==23.1.5"
# The integrations' tests (test_lightning.py, test_hf.py, test_ray.py), and deepspeed, the peer
# of benchmarks/host_collectives.py (its shared-memory allreduce), with torch pinned to the one
# installed so that pip never swaps it for another build.
$PY -m pip install -q "lightning>=2.0" accelerate transformers "ray[train]>=2.9" deepspeed \
  "torch==$($PY -c 'import torch; print(torch.__version__.split("+")[0])')"
# The project's own build: warnings are errors (RUMOR_WERROR, off for users' builds).
source scripts/ccache_env.sh
$PY -m pip install -q --no-build-isolation -C cmake.define.RUMOR_WERROR=ON .
$PY -c "import rumor, rumor._C as c; print('setup: rumor', rumor.__version__, 'installed; reduction kernels:', c.reduce_isa())"

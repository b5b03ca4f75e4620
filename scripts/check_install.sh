#!/usr/bin/env bash
# What a newcomer gets from `pip install`: builds an sdist and, from that sdist, a wheel
# (`python -m build`, so the wheel proves the sdist is complete), installs the wheel into a fresh
# virtual environment next to torch, then, outside the checkout, imports rumor and runs a 2-rank
# allreduce through the installed launcher. Called by scripts/test.sh after the Python tests.
#
#   bash scripts/check_install.sh
#
# TORCH_SPEC (default torch==2.13.0, the one torch version CI tests; docs/install.md) picks the
# torch installed into the venv. Everything is built and installed under one temporary directory,
# removed on exit. The build compiles the C++ core (without the CUDA kernels, see below):
# minutes on a loaded 2-core machine, hence the generous timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

work=$(mktemp -d "${TMPDIR:-/tmp}/rumor-check-install.XXXXXX")
trap 'rm -rf "$work"' EXIT

now() { date +%s; }
step() { echo "check_install: $*"; }

t0=$(now)
step "python -m build (sdist, then a wheel from the sdist) into $work/dist"
# RUMOR_WERROR: the project's own builds keep warnings fatal; users' builds (the default) do not.
# RUMOR_CUDA=OFF: the packaging is what is checked here; the CUDA kernels are compiled (with nvcc,
# where found) by setup.sh's build of the same sources, and would triple this build's time.
# The isolated build environment and the unpacked sdist under $work, hashed relative to it
# (scripts/ccache_env.sh): the core's objects come from ccache when an earlier run built them.
source scripts/ccache_env.sh
export CCACHE_BASEDIR="$work"
TMPDIR="$work" timeout 3600 "$PY" -m build --outdir "$work/dist" -C cmake.define.RUMOR_WERROR=ON -C cmake.define.RUMOR_CUDA=OFF "$REPO" >"$work/build.log" 2>&1 ||
  { tail -60 "$work/build.log"; step "FAILED: python -m build"; exit 1; }
t_build=$(($(now) - t0))
sdist=$(ls "$work"/dist/rumor-*.tar.gz)
wheel=$(ls "$work"/dist/rumor-*.whl)
step "built $(basename "$sdist") ($(du -k "$sdist" | cut -f1) KiB) and $(basename "$wheel") in ${t_build}s"

# The sdist carries what a build needs and not the repository's bulk; the wheel carries the
# extension this build made, never a copy lying in the source tree.
members=$(tar tzf "$sdist")
for need in CMakeLists.txt pyproject.toml LICENSE README.md csrc/bindings python/rumor/__init__.py; do
  grep -q "^rumor-[^/]*/$need" <<<"$members" || { step "FAILED: the sdist lacks $need"; exit 1; }
done
if grep -qE '^rumor-[^/]*/(tests|docs/benchmarks)/|\.so$' <<<"$members"; then
  step "FAILED: the sdist holds tests, docs/benchmarks or a built .so:"
  grep -E '^rumor-[^/]*/(tests|docs/benchmarks)/|\.so$' <<<"$members" | head
  exit 1
fi
"$PY" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
exts = [n for n in names if n.startswith("rumor/_C") and n.endswith(".so")]
tag = sys.argv[1].rsplit("-", 3)[1]  # the wheel's python tag, e.g. cp311
want = [n for n in exts if f"-{tag[2:]}-" in n or f".{tag}-" in n]
if len(exts) != 1 or not want:
    sys.exit(f"check_install: FAILED: the wheel should hold exactly this interpreter's rumor/_C*.so, holds {exts}")
for n in ("rumor/lib/libnccl-net-rumor.so", "rumor/lib/rumor-wanem", "rumor/__init__.py"):
    if n not in names:
        sys.exit(f"check_install: FAILED: the wheel lacks {n}")
if not any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names):
    sys.exit("check_install: FAILED: the wheel carries no LICENSE")
EOF

t1=$(now)
step "fresh venv; pip install $TORCH_SPEC, then the wheel"
timeout 300 "$PY" -m venv "$work/venv"
VPY="$work/venv/bin/python"
timeout 900 "$VPY" -m pip install -q "$TORCH_SPEC"
timeout 900 "$VPY" -m pip install -q "$wheel"
t_install=$(($(now) - t1))
step "installed in ${t_install}s: $("$VPY" -m pip list 2>/dev/null | grep -E '^(rumor|torch|numpy|networkx) ' | tr -s ' ' | paste -sd, -)"

# From a directory outside the checkout, so that the installed package is the one imported.
mkdir -p "$work/run"
cd "$work/run"
timeout 120 "$VPY" -c "import rumor, os; assert '$work/venv' in rumor.__file__, rumor.__file__; print('check_install: import rumor', rumor.__version__, 'from', os.path.dirname(rumor.__file__))"

cat >allreduce.py <<'EOF'
import sys

import torch

import rumor

rumor.init()
r, n = rumor.rank(), rumor.size()
# Small integers in float32: the sum is exact, so the check is equality.
t = torch.arange(1000, dtype=torch.float32) * (r + 1)
rumor.allreduce_(t, op=rumor.ReduceOp.SUM)
want = torch.arange(1000, dtype=torch.float32) * (n * (n + 1) // 2)
if n != 2 or not torch.equal(t, want):
    print(f"rank {r}: allreduce gave {t[:4].tolist()}..., want {want[:4].tolist()}... (size {n})", file=sys.stderr)
    sys.exit(1)
print(f"rank {r}: allreduce of 2 ranks exact")
rumor.shutdown()
EOF
t2=$(now)
timeout 180 "$VPY" -m rumor.run --nproc-per-node 2 allreduce.py
step "2-rank allreduce ok in $(($(now) - t2))s"
step "ok: build ${t_build}s, venv install ${t_install}s, total $(($(now) - t0))s"

#!/usr/bin/env bash
# Runs BlueFog's own torch test files against rumor.compat.bluefog (not part of CI).
#
#   scripts/run_bluefog_suite.sh /path/to/bluefog-checkout [nprocs...]
#
# For each test file and each world size (default 2 and 4) it starts the ranks with torchrun;
# every rank runs pytest on the file with `bluefog` aliased to rumor.compat.bluefog. The
# aliasing shim lives in a temporary directory, never in this repository or in the checkout.
# Per-file JUnit XML and logs land in $OUT (default ./bluefog-suite-results); a summary of
# rank 0's pass/fail counts is printed at the end. RUMOR_TIMEOUT bounds every blocking wait
# (default 30 s), so a case that desynchronizes the ranks fails instead of hanging.
set -euo pipefail
checkout=${1:?usage: $0 /path/to/bluefog-checkout [nprocs...]}
shift || true
sizes=("$@")
[ ${#sizes[@]} -eq 0 ] && sizes=(2 4)
tests=${BLUEFOG_TESTS:-"torch_basics_test.py torch_ops_test.py torch_hierarchical_test.py torch_win_ops_test.py torch_optimizer_test.py timeline_test.py"}
out=${OUT:-$PWD/bluefog-suite-results}
mkdir -p "$out"
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
cat > "$shim/bf_rank.py" <<'PY'
import os
import sys

# BlueFog's tests read the MPI launcher's variables for the true rank and size.
os.environ.setdefault("PMI_RANK", os.environ["RANK"])
os.environ.setdefault("PMI_SIZE", os.environ["WORLD_SIZE"])
import rumor.compat

rumor.compat.enable_aliases(bluefog=True, bagua=False)
# BlueFog's tests call networkx.to_numpy_matrix, which networkx 3 removed.
import networkx as nx
import numpy as np

if not hasattr(nx, "to_numpy_matrix"):
    nx.to_numpy_matrix = lambda g, **kw: np.asmatrix(nx.to_numpy_array(g, **kw))
import pytest

test, xml = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
args = \
       [test, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
if rank == 0:
    args += ["--junitxml", xml, "-rfE"]
else:
    args += ["-q"]
code = pytest.main(args)
sys.stdout.flush()
os._exit(int(code))
PY
cd "$checkout/test"
for n in "${sizes[@]}"; do
  for t in $tests; do
    [ -f "$t" ] || { echo "missing $t"; continue; }
    base="${t%.py}.np$n"
    echo "== $t with $n ranks"
    RUMOR_TIMEOUT=${RUMOR_TIMEOUT:-30} timeout ${SUITE_FILE_TIMEOUT:-900} \
      python -m torch.distributed.run --standalone --nproc-per-node "$n" --no-python "$(command -v python)" "$shim/bf_rank.py" "$t" "$out/$base.xml" \
      > "$out/$base.log" 2>&1 || true
    python - "$out/$base.xml" <<'PY' || echo "   (no result file; see the log)"
import sys
import xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
s = r if r.tag == "testsuite" else r.find("testsuite")
print(f"   tests={s.get('tests')} failures={s.get('failures')} errors={s.get('errors')} skipped={s.get('skipped')}")
PY
  done
done

#!/usr/bin/env bash
# The main job: builds rumor, then trains the same model with rumor and with torch DDP (gloo)
# on 4 CPU processes, side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m rumor.run --nproc-per-node "${NPROC:-4}" benchmarks/vs_ddp.py "$@"

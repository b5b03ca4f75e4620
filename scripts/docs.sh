#!/usr/bin/env bash
# Builds the docs site (mkdocs.yml) in strict mode into a temporary directory: any warning (a
# broken link or anchor, a page missing from nav, a docstring naming a parameter that does not
# exist, a reference to a name that does not resolve) fails with a nonzero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export NO_MKDOCS_2_WARNING=1
start=$(date +%s%N)
"${PYTHON:-python3}" -m mkdocs build --strict --site-dir "$tmp" "$@"
end=$(date +%s%N)
echo "docs: built in $(( (end - start) / 1000000 )) ms (strict)"

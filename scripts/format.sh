#!/usr/bin/env bash
# clang-format over the project's own C, C++ and CUDA sources (.clang-format), at one pinned
# version: formatters of different versions disagree on the same config (trailing comments,
# wrapping), so the check and the fix must be the same binary. scripts/setup.sh installs it.
#   bash scripts/format.sh           rewrite the files in place
#   bash scripts/format.sh --check   list the files it would change and exit 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."
want=23.1.5
PY=${PYTHON:-python3}
# The pip package's own binary, not a clang-format that happens to be first on PATH.
cf=$($PY -c 'import clang_format, os; print(os.path.join(os.path.dirname(clang_format.__file__), "data", "bin", "clang-format"))' 2>/dev/null || true)
if [ -z "$cf" ] || [ ! -x "$cf" ]; then
  echo "format: clang-format $want is not installed (scripts/setup.sh, or: $PY -m pip install clang-format==$want)" >&2
  exit 2
fi
have=$("$cf" --version | sed -E 's/.*version ([0-9.]+).*/\1/')
if [ "$have" != "$want" ]; then
  echo "format: clang-format $have found, $want wanted (the check and the fix must agree)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -- '*.c' '*.cc' '*.cpp' '*.h' '*.hpp' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    "$cf" --style=file "$f" | cmp -s - "$f" || bad+=("$f")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "format: ${#bad[@]} file(s) differ from clang-format $want (run: bash scripts/format.sh):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files as clang-format $want writes them"
else
  "$cf" --style=file -i "${files[@]}"
  echo "format: ${#files[@]} files formatted with clang-format $want"
fi

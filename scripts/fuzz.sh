#!/usr/bin/env bash
# Coverage-guided fuzzing of what rumor parses from peers and from shared places:
# tests/fuzz/fuzz_*.cpp (libFuzzer, clang, ASan+UBSan) and tests/fuzz/fuzz_*.py (atheris).
#
#   bash scripts/fuzz.sh [SECONDS_EACH] [NAME ...]     default: 600 s each, every target
#
# CI runs each target for a few seconds (scripts/test.sh); the 10-minute runs are this script's
# default. A finding (crash, sanitizer report, leak, unexpected exception) stops that target,
# leaves its reproducer under build/fuzz/findings/NAME/ and makes the script exit non-zero.
# Corpora persist in build/fuzz/corpus/NAME, so later runs start where earlier ones stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-600}
shift || true
CXX_FUZZ=${CXX_FUZZ:-clang++-14}
PY=${PYTHON:-python3}
OUT=build/fuzz
mkdir -p "$OUT"

want() {  # NAME: selected by the command line (all when none named)
  [ $# -ge 1 ] || return 0
  local n=$1
  shift
  [ ${#SELECT[@]} -eq 0 ] && return 0
  for s in "${SELECT[@]}"; do [ "$s" = "$n" ] && return 0; done
  return 1
}
SELECT=("$@")

fail=0
summary=()
for src in tests/fuzz/fuzz_*.cpp tests/fuzz/fuzz_*.py; do
  [ -e "$src" ] || continue
  name=$(basename "$src")
  name=${name%.*}
  want "$name" || continue
  corpus="$OUT/corpus/$name"
  findings="$OUT/findings/$name"
  mkdir -p "$corpus" "$findings"
  log="$OUT/$name.log"
  if [[ $src == *.cpp ]]; then
    # The sources a target needs are named on its "// sources:" line.
    srcs=$(sed -n 's@^// sources:\(.*\)$@\1@p' "$src" | head -1)
    bin="$OUT/$name"
    if [ ! -x "$bin" ] || [ -n "$(find "$src" $srcs csrc -newer "$bin" -name '*.[ch]*' -print -quit)" ]; then
      echo "fuzz: building $name"
      # shellcheck disable=SC2086
      $CXX_FUZZ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        -Icsrc "$src" $srcs -lcrypto -pthread -o "$bin"
    fi
    cmd=("$bin" -max_total_time="$SECS" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$findings/" "$corpus")
  else
    cmd=("$PY" "$src" -max_total_time="$SECS" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096 -artifact_prefix="$findings/" "$corpus")
  fi
  echo "fuzz: $name for ${SECS}s"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     "${cmd[@]}" >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    [ -n "$runs" ] || runs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
    summary+=("$name: ok, ${runs:-?} inputs, ${cov:-cov ?}, corpus $(ls "$corpus" | wc -l) files")
  else
    fail=1
    summary+=("$name: FINDING (see $log and $findings/)")
    tail -40 "$log"
  fi
done
printf 'fuzz: %s\n' "${summary[@]}"
exit $fail

# Sourced by setup.sh and test.sh: every CMake build they start (the package, the ASan tests, the
# sanitizer and fuzz builds) compiles through ccache when it is installed, so a run of the test
# suite after another recompiles only what changed. Paths are hashed relative to the checkout
# (CCACHE_BASEDIR), so two clones of the same commit share the cache; ccache keys on the
# preprocessed source, the compiler and every flag, so a hit is the object the compiler would
# produce. RUMOR_CCACHE=0 turns it off.
if [ "${RUMOR_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  # Not the build directory either (with -g ccache hashes it): the ASan build's debug info may
  # then name the clone that compiled a file first, which changes only paths in sanitizer reports.
  export CCACHE_NOHASHDIR=1
fi

"""``python -m rumor.advise [--nproc-per-node N] script.py [args]``: the advisor's command line.

The advisor itself lives in rumor.advisor; ``rumor.advise(...)`` is its API function (this module
is only the ``-m`` entry point, so that the package's ``rumor.advise`` stays the function).
"""
import sys

from rumor.advisor import main

if __name__ == "__main__":
    sys.exit(main())

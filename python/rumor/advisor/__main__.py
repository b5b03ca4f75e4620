"""``python -m rumor.advisor``: the advisor's command line (rumor.advisor.cli)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m distvals.bench``: see ``python -m distvals.bench --help``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

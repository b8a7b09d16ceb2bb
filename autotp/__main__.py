"""``python -m autotp ...``: the same command line as the ``autotp`` console script."""

import sys

from autotp.cli import main

if __name__ == "__main__":
    sys.exit(main())

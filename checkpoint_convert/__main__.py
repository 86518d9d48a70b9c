"""Entry point: `python -m checkpoint_convert --help`."""

import sys

from checkpoint_convert.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvpack ...``: the same command line as the ``kvpack`` console script."""

import sys

from .cli import main

sys.exit(main())

"""``python -m kvpack.cli``: the ``kvpack`` command."""

import sys

from . import main

sys.exit(main())

"""``python -m benchmarks.coverage``: the same as ``python -m benchmarks coverage``."""

import sys

from . import main

sys.exit(main())

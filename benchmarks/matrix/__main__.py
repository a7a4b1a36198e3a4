"""``python -m benchmarks.matrix``: the same as ``python -m benchmarks matrix``."""

import sys

from . import main

sys.exit(main())

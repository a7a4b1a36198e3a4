"""``python -m benchmarks.backends``: the same as ``python -m benchmarks backends``."""

import sys

from . import main

sys.exit(main())

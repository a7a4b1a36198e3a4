"""``python -m benchmarks.interop``: the same as ``python -m benchmarks interop``."""

import sys

from . import main

sys.exit(main())

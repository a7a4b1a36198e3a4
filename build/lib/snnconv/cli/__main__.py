"""``python -m snnconv.cli``: the ``snnconv`` command."""

import sys

from . import main

sys.exit(main())

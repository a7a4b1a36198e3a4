"""``python -m snnconv.cli``: the ``snnconv`` command."""

import sys

from snnconv.cli import main

sys.exit(main())

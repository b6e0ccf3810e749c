"""``python -m transcover``: the command line (same as the ``transcover`` script)."""

import sys

from .cli import main

sys.exit(main())

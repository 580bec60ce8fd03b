"""``python -m kvtier.cli``: the same entry point as the ``kvtier`` script."""

import sys

from kvtier.cli.main import main

sys.exit(main())

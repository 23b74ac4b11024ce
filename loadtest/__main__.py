"""``python -m loadtest``: the load generator CLI."""

import sys

from loadtest.cli import main

sys.exit(main())

"""``python -m benchmarks``: see `benchmarks.compare`."""

import sys

from .compare import main

sys.exit(main())

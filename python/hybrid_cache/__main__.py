"""`python -m hybrid_cache ...` runs the same CLI as the `hybrid-cache` console script."""

import sys

from hybrid_cache.cli import main

sys.exit(main())

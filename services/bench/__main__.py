"""`python -m weir.services.bench throughput|serve ...` runs `weir bench ...`."""

import sys

from weir.services.bench import run_cli

sys.exit(run_cli(sys.argv[1:]))

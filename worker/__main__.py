"""`python -m worker` is `qbatch-worker`.

The guard matters: vLLM may start its engine processes with `spawn`, which
re-imports the parent's main module.
"""

import sys

from worker.cli import main

if __name__ == "__main__":
    sys.exit(main())

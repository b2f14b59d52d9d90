"""`python -m worker` is `qbatch-worker`."""

import sys

from worker.cli import main

sys.exit(main())

"""`python -m watchdog ...` is `hbm-watchdog ...`: handy where the console script is not on PATH."""

import sys

from watchdog.commands.cli import main

sys.exit(main())

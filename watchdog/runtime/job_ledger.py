"""Moved to `watchdog.records.job_ledger` (the files read from outside the process, together: issue 59).
This name keeps working for one release, the same module under its old name, with a deprecation line."""

import sys
import warnings

from watchdog.records import job_ledger

warnings.warn("watchdog.runtime.job_ledger moved to watchdog.records.job_ledger; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = job_ledger

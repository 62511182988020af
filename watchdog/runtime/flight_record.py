"""Moved to `watchdog.records.flight_record` (the files read from outside the process, together: issue 59).
This name keeps working for one release, the same module under its old name, with a deprecation line."""

import sys
import warnings

from watchdog.records import flight_record

warnings.warn("watchdog.runtime.flight_record moved to watchdog.records.flight_record; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = flight_record

"""Moved to `watchdog.readers.breakdown_plan` (the readers together: issue 59). This name keeps working for one
release, the same module under its old name, with a deprecation line."""

import sys
import warnings

from watchdog.readers import breakdown_plan

warnings.warn("watchdog.runtime.breakdown_plan moved to watchdog.readers.breakdown_plan; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = breakdown_plan

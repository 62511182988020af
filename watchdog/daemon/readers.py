"""Moved to `watchdog.readers.outside` (the readers together: issue 59). This name keeps working for one
release, the same module under its old name, with a deprecation line."""

import sys
import warnings

from watchdog.readers import outside

warnings.warn("watchdog.daemon.readers moved to watchdog.readers.outside; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = outside

"""Moved to `watchdog.readers.sources` (the readers together: issue 59). This name keeps working for one
release, the same module under its old name, with a deprecation line."""

import sys
import warnings

from watchdog.readers import sources

warnings.warn("watchdog.runtime.sources moved to watchdog.readers.sources; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = sources

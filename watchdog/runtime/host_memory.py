"""Moved to `watchdog.readers.host_memory` (the readers together: issue 59). This name keeps working for one
release, the same module under its old name, with a deprecation line."""

import sys
import warnings

from watchdog.readers import host_memory

warnings.warn("watchdog.runtime.host_memory moved to watchdog.readers.host_memory; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = host_memory

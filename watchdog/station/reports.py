"""Deprecated (0.1): moved to `watchdog.station.blocks`, the terminal's blocks. Kept one release."""

import warnings

from watchdog.station.blocks import ActionOutcome, RunSummary, oom_text, rate_text  # noqa: F401

warnings.warn("watchdog.station.reports is deprecated; import watchdog.station.blocks (ActionReport is now "
              "ActionOutcome)", DeprecationWarning, stacklevel=2)

ActionReport = ActionOutcome

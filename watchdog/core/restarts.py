"""How many times the job has been restarted, as its restart engine tells each new process.

`hbm-watchdog supervise` sets `HBMWATCH_RESTART_COUNT` (JobSet's manifests set the same variable
from the pod's restart-attempt annotation through the downward API); torchrun sets
`TORCHELASTIC_RESTART_COUNT`. The first one set wins; neither: 0, a first start.
"""

from __future__ import annotations

from watchdog.core.errors import InputError
from watchdog.core.numbers import parse_count

RESTART_COUNT_ENV = "HBMWATCH_RESTART_COUNT"
TORCHRUN_RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def restarts_so_far(environ) -> int:
    """The job's restarts so far; a value that is no count is one line naming the variable (InputError)."""
    for name in (RESTART_COUNT_ENV, TORCHRUN_RESTART_COUNT_ENV):
        text = environ.get(name, "").strip()
        if text:
            try:
                return parse_count(text)
            except InputError as exc:
                raise InputError(f"{name}: {exc}") from None
    return 0

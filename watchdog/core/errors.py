"""Errors that mean "the user gave us something wrong".

Entry points turn any `InputError` into one line on stderr and exit status 2 (watchdog/ARCHITECTURE.md);
everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_RESTART_REQUESTED = 42  # checkpoint saved, restart me (the XPK/JobSet convention)
EXIT_PEER_LOST = 43  # another rank died or stalled during an agreement: nothing saved here, restart the job
EXIT_UNSAVED = 44  # a restart is needed but the disk refused its checkpoint: restart from the newest one there is
EXIT_FUTILE = 45  # checkpoint saved, but restarting will not save this job (core/cycles.py): do not restart, fix the leak
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): checkpoint saved, stopped (the shell's 128 + 2)


class InputError(ValueError):
    """Bad input or configuration; the message is one line a user can act on."""


class ConfigError(InputError):
    """A configuration field has a bad value; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class TraceFormatError(InputError):
    """A trace file is not in the trace CSV format; the message names the file and line."""

    def __init__(self, path: str, line: int, problem: str):
        super().__init__(f"{path}:{line}: {problem}")
        self.path = path
        self.line = line

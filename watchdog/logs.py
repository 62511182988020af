"""Structured logging: library modules log through stdlib loggers; entry points choose the rendering.

`get_logger(__name__)` gives a structlog logger wrapped around `logging.getLogger(name)`, so a
user's logging setup (levels, handlers) applies. Only entry points (the CLI) call
`configure_logging`, which picks one of two renderings for the same events:

- JSON lines (not a TTY, or `--log-format json`): every event with every field, raw numbers in
  base units. This is the contract for log pipelines; nothing here changes its content.
- The console (a TTY): what a person glancing at a ten-hour job wants. Routine start-up detail
  (which memory source, where the trace goes) is shown only at `--log-level debug`; numbers carry
  their units (`1.88 GiB`, `+4.0 MiB/step`, `8 s`); events that carry a pre-rendered `block`
  (the watchdog's action report, the end-of-run summary) are printed as that block. A progress
  bar, when one is drawn, cooperates through tqdm's logging redirection (`trainer/progress.py`).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import sys
from typing import IO

import structlog

from watchdog.core.errors import InputError
from watchdog.core.inputs import open_regular
from watchdog.core.units import format_bytes, format_duration

_PRE_CHAIN = [
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]

LEVELS = ("debug", "info", "warning", "error")

# Events a person does not need on a terminal unless debugging; JSON logs keep them all. The
# second line's events are parts of the action block (`action_outcome`), which shows them together.
ROUTINE_EVENTS = frozenset({
    "memory_source_unavailable", "memory_source_selected", "watchdog_started",
    "watchdog_stopped", "metrics_serving", "checkpoint_loaded", "checkpoint_saved",
    "checkpoint_stale_temporary_removed", "child_started", "train_progress", "spmd_mesh",
    "leak_suspects", "reinitialised", "reinit_measured", "leak_baseline_taken",
    "train_finished",  # the console prints the run's summary table instead
})


# Log events renamed, new name -> old. For one release each is also written under its old name,
# with a `deprecated` field, so a log pipeline that selects the old name keeps working while it
# moves; the console shows only the new one. docs/CHANGELOG.md lists them.
RENAMED_EVENTS = {
    "action_decided": "watchdog_action",  # what the watchdog decided for a series, and why
    "action_outcome": "watchdog_acted",  # the action's block: what the loop did with it, what it gave back
}


def log_event(logger, level: int, event: str, **fields) -> None:
    """`logger.log(level, event, ...)`, and the same line under the event's old name while it is kept."""
    logger.log(level, event, **fields)
    old = RENAMED_EVENTS.get(event)
    if old is not None:
        logger.log(level, old, **fields, deprecated=f"renamed {event}; this old name goes in the next release")


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, *_PRE_CHAIN,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def console_wanted(fmt: str = "auto") -> bool:
    return fmt == "console" or (fmt == "auto" and sys.stderr.isatty())


def configure_logging(fmt: str = "auto", level: int | str = logging.INFO, log_file: IO[str] | None = None) -> None:
    """Install one stderr handler on the root logger: `json`, `console`, or `auto` (console on a TTY);
    with `log_file` (see `open_log_file`), every event also goes there as a JSON line, whatever stderr shows."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    console = console_wanted(fmt)
    if console:
        processors = [structlog.stdlib.ProcessorFormatter.remove_processors_meta, with_units,
                      structlog.processors.format_exc_info, _render_blocks_or(
                          structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))]
    else:
        processors = _JSON_CHAIN
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=processors, foreign_pre_chain=_PRE_CHAIN))
    if console:
        handler.addFilter(_without_old_names)
    if console and numeric > logging.DEBUG:
        handler.addFilter(_without_routine_events)
    handlers = [handler]
    if log_file is not None:
        handlers.append(SinkHandler(log_file))
        handlers[-1].setFormatter(structlog.stdlib.ProcessorFormatter(processors=_JSON_CHAIN,
                                                                      foreign_pre_chain=_PRE_CHAIN))
    root = logging.getLogger()
    for old in list(root.handlers):  # an entry point owns the process's logging (torch_xla's import adds one)
        root.removeHandler(old)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(numeric)


class SinkHandler(logging.StreamHandler):
    """A stream handler for a sink that may fail (`--log-file` on a full disk): the failure is said
    once on stderr, with its reason, and the run goes on; logging's default printed a traceback
    for every event (54 stderr lines for 2 events)."""

    def __init__(self, stream: IO[str]):
        super().__init__(stream)
        self.failures = 0

    def handleError(self, record: logging.LogRecord) -> None:
        self.failures += 1
        if self.failures > 1:
            return
        error = sys.exc_info()[1]
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        name = getattr(self.stream, "name", "the log file")
        try:
            sys.stderr.write(f"hbm-watchdog: cannot write the log to {name} ({reason}); the run goes on, "
                             "and later lines there are lost while it fails\n")
        except Exception:  # noqa: BLE001 - stderr gone too: nothing left to say it on
            pass


_JSON_CHAIN = [structlog.stdlib.ProcessorFormatter.remove_processors_meta,
               structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]


def open_log_file(path: str | os.PathLike) -> IO[str]:
    """`--log-file`: appended to, as logs are, and line-buffered, so a killed run keeps every line it
    logged. Never through a link, and only a regular file: a path that points elsewhere is refused."""
    try:
        return open_regular(path, "a", what="--log-file ", follow_symlinks=False, buffering=1, encoding="utf-8")
    except OSError as exc:
        reason = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise InputError(f"--log-file {os.fspath(path)!s}: cannot write it ({reason})") from None


def _without_old_names(record: logging.LogRecord) -> bool:
    """A person sees a renamed event once, under its new name."""
    return not (isinstance(record.msg, dict) and record.msg.get("event") in _OLD_NAMES and "deprecated" in record.msg)


_OLD_NAMES = frozenset(RENAMED_EVENTS.values())


def _without_routine_events(record: logging.LogRecord) -> bool:
    event = record.msg.get("event") if isinstance(record.msg, dict) else None
    return event not in ROUTINE_EVENTS


# ---- the console's processors: pure functions of the event dict ---------------------------------

def with_units(_logger, _name, event: dict) -> dict:
    """Numbers a person reads, with units: `*_bytes`, `bytes_*`, `*_bytes_per_step`, `*_seconds` fields;
    step counts whole, other floats to four significant digits.

    Only the console chain runs this; JSON keeps raw base units for machines.
    """
    for key, value in event.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.endswith("_bytes_per_step"):
            event[key] = f"{'+' if value >= 0 else ''}{format_bytes(value)}/step"
        elif key == "bytes" or key.endswith("_bytes") or key.startswith("bytes_"):
            event[key] = format_bytes(value)
        elif key.endswith("_seconds") and math.isfinite(value):
            event[key] = format_duration(value)
        elif key.endswith("_steps") and math.isfinite(value):
            event[key] = f"{value:,.0f}"
        elif isinstance(value, float) and math.isfinite(value):
            event[key] = float(f"{value:.4g}")
    return event


def _render_blocks_or(renderer):
    """Events that carry a ready `block` of text print as that block; the rest go to `renderer`."""

    def render(logger, name, event: dict) -> str:
        block = event.get("block")
        if isinstance(block, str) and block:
            return block
        return renderer(logger, name, event)

    return render




class OncePerKind:
    """Logs the first error of each kind and counts every one: a fault that repeats at every sample
    (a full disk, a device that stopped answering) is one line in the log, not a flood, and the
    count (the caller's Prometheus counter) still has them all.

    `kind` is where it failed (`trace_write`, `host_read`), `cause` what failed (an errno's text,
    an exception's type): a new cause at the same place is news, and is logged."""

    NOTE = "further errors of this kind are counted, not logged"

    def __init__(self, logger, event: str, *, level: str = "warning"):
        self._log = getattr(logger, level)
        self._event = event
        self._logged: set[tuple[str, str]] = set()
        self.count = 0

    def __call__(self, kind: str, cause: str, **fields) -> bool:
        """Count one error; log it (with `fields`, and a note unless given one) if its kind and
        cause are new. True when it was logged."""
        self.count += 1
        if (kind, cause) in self._logged:
            return False
        self._logged.add((kind, cause))
        fields.setdefault("note", self.NOTE)
        self._log(self._event, kind=kind, **fields)
        return True


def exception_text(exc: BaseException) -> str:
    """An exception as one log field: `OSError: [Errno 28] No space left on device`."""
    return f"{type(exc).__name__}: {exc}"

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
from watchdog.core.printable import printable, printable_lines
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


def log_event(logger, level: int, event: str, **fields) -> None:
    """`logger.log(level, event, ...)`, for an event whose level is chosen at run time (the station's
    lines go through here: tests/test_station.py lists them from these calls). One name per event."""
    logger.log(level, event, **fields)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, *_PRE_CHAIN, _readable],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


class Event(dict):
    """An event's fields, as structlog hands them to a stdlib record. Our formatters read the dict;
    any other formatter reads `str(event)`, a line a person reads (`action_decided: step=3
    action=checkpoint_reinit ...`, or the event's block), not a Python dict: a user's
    `logging.basicConfig()`, Lightning's and Hugging Face's set-ups print our events as text."""

    def __str__(self) -> str:
        return render_text(self)


def render_text(event: dict) -> str:
    """One event as text for a person: its block, or its name and fields with units."""
    event = _printable(None, None, with_units(None, None, dict(event)))
    block = _block_of(event)
    if block is not None:
        return block
    fields = " ".join(f"{key}={value}" for key, value in event.items() if key not in _NOT_SHOWN)
    return f"{event.get('event', '')}: {fields}" if fields else str(event.get("event", ""))


_NOT_SHOWN = frozenset({"event", "level", "logger", "timestamp", "block", "_record", "_from_structlog"})


def _block_of(event: dict) -> str | None:
    """The text an event prints as a block, or None: its ready `block`, or for the census after a
    capture, what is leaking with the lines that made it (the README's promise)."""
    block = event.get("block")
    if isinstance(block, str) and block:
        return block
    if event.get("event") == "leak_suspects" and event.get("creation_sites"):
        return _suspects_text(event)
    return None


def _suspects_text(event: dict) -> str:
    step = event.get("step")
    title = f"what is leaking, at step {step:,}:" if isinstance(step, int) else "what is leaking:"
    return "\n".join([title, *(f"  {line}" for line in event.get("suspects") or [])])


def _readable(logger, name: str, event_dict: dict):
    return structlog.stdlib.ProcessorFormatter.wrap_for_formatter(logger, name, Event(event_dict))


def console_wanted(fmt: str = "auto") -> bool:
    return fmt == "console" or (fmt == "auto" and sys.stderr.isatty())


def configure_logging(fmt: str = "auto", level: int | str = logging.INFO, log_file: IO[str] | None = None,
                      log_file_name: str | None = None) -> None:
    """Install one stderr handler on the root logger: `json`, `console`, or `auto` (console on a TTY);
    with `log_file` (see `open_log_file`; `log_file_name`: its path, for the line that says it failed),
    every event also goes there as a JSON line, whatever stderr shows."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    console = console_wanted(fmt)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=_chain(console), foreign_pre_chain=_PRE_CHAIN))
    if console and numeric > logging.DEBUG:
        handler.addFilter(_without_routine_events)
    handlers = [handler]
    if log_file is not None:
        handlers.append(SinkHandler(log_file, log_file_name))
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

    def __init__(self, stream: IO[str], name: str | None = None):
        super().__init__(stream)
        self.failures = 0
        given = getattr(stream, "name", None)  # a stream opened from a descriptor is named by its number
        self.sink_name = name or (given if isinstance(given, str) else "the log file")

    def handleError(self, record: logging.LogRecord) -> None:
        self.failures += 1
        if self.failures > 1:
            return
        error = sys.exc_info()[1]
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        try:
            sys.stderr.write(f"hbm-watchdog: cannot write the log to {printable(self.sink_name)} ({reason}); the run goes on, "
                             "and later lines there are lost while it fails\n")
        except Exception:  # noqa: BLE001 - stderr gone too: nothing left to say it on
            pass


_JSON_CHAIN = [structlog.stdlib.ProcessorFormatter.remove_processors_meta,
               structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]


def _chain(console: bool) -> list:
    """The formatter's processors: the console's (units, blocks) or JSON lines (raw base units)."""
    if not console:
        return _JSON_CHAIN
    return [structlog.stdlib.ProcessorFormatter.remove_processors_meta, with_units,
            structlog.processors.format_exc_info, _printable,
            _render_blocks_or(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))]


def open_log_file(path: str | os.PathLike) -> IO[str]:
    """`--log-file`: appended to, as logs are, and line-buffered, so a killed run keeps every line it
    logged. Never through a link, and only a regular file: a path that points elsewhere is refused."""
    try:
        return open_regular(path, "a", what="--log-file ", follow_symlinks=False, buffering=1, encoding="utf-8")
    except OSError as exc:
        reason = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise InputError(f"--log-file {os.fspath(path)!s}: cannot write it ({reason})") from None


def _without_routine_events(record: logging.LogRecord) -> bool:
    """Routine events stay off the console; the census that names where the leak is made does not
    (the action's block carries the census at the action, not the one after the capture)."""
    if not isinstance(record.msg, dict):
        return True
    event = record.msg.get("event")
    return event not in ROUTINE_EVENTS or (event == "leak_suspects" and bool(record.msg.get("creation_sites")))


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


def _printable(_logger, _name, event: dict) -> dict:
    """The console's fields made printable: a path, a label or a suspect line read from a file never
    acts on the terminal (the renderer adds its own colours after this)."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = printable_lines(value) if key == "block" else printable(value)
        elif isinstance(value, list) and any(isinstance(item, str) for item in value):
            event[key] = [printable(item) if isinstance(item, str) else item for item in value]
    return event


def _render_blocks_or(renderer):
    """Events that carry a ready `block` of text print as that block (so does the census that names
    where the leak is made); the rest go to `renderer`."""

    def render(logger, name, event: dict) -> str:
        block = _block_of(event)
        return block if block is not None else renderer(logger, name, event)

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


# ---- nothing configured: the library's own events still reach a person, or a pipe --------------

_FALLBACK = "hbm-watchdog fallback"


class _WhileNothingElse(logging.Filter):
    """Lets a record through only while the application has configured no logging of its own (the
    root logger has no handler): once it has, its set-up shows our events, and this one steps aside."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def ensure_readable_output() -> None:
    """Called when a `Watchdog` starts. A library does not take over the application's logging; but
    where nothing is configured, Python's last resort printed our events as Python dicts (and the
    action's block as one escaped string). So, on the `watchdog` logger only, and only while the root
    logger has no handler: on a terminal, the console's rendering (blocks as blocks, units); in a
    file or a pipe, strict JSON lines. Levels are left as they are (WARNING and up, Python's
    default). Route the events anywhere else with the standard library, or `configure_logging`."""
    logger = logging.getLogger("watchdog")
    if any(handler.get_name() == _FALLBACK for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_FALLBACK)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=_chain(console_wanted("auto")),
                                                             foreign_pre_chain=_PRE_CHAIN))
    handler.addFilter(_WhileNothingElse())
    handler.addFilter(_without_routine_events)
    logger.addHandler(handler)


def exit_process(code: int) -> None:
    """End the process now, whatever the training thread is stuck in, the stdio buffers flushed first:
    the lines that say why (a stall, a peer lost) reach the reader. The stall watch and the agreement
    end a process this way (exit 43)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not keep the process alive
            pass
    os._exit(code)

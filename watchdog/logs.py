"""Structured logging: library modules log through stdlib loggers; entry points choose the rendering.

`get_logger(__name__)` gives a structlog logger wrapped around `logging.getLogger(name)`, so a
user's logging setup (levels, handlers) applies. Only entry points (CLI, trainer) call
`configure_logging`, which renders JSON lines by default and a readable console on a TTY.
"""

from __future__ import annotations

import logging
import sys

import structlog

_PRE_CHAIN = [
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, *_PRE_CHAIN,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure_logging(fmt: str = "auto", level: int | str = logging.INFO) -> None:
    """Install one stderr handler on the root logger: `json`, `console`, or `auto` (console on a TTY)."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info, renderer],
            foreign_pre_chain=_PRE_CHAIN,
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):  # an entry point owns the process's logging (torch_xla's import adds one)
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # it logs every run of every job at INFO

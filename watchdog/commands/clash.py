"""The import name `watchdog` is also the name of a widely installed file-events package.

`pip install watchdog` (pulled in by many tools) and `pip install hbm-watchdog` write into the
same `site-packages/watchdog/` folder: whichever comes second overwrites the other's
`__init__.py`, and uninstalling either one removes files the other needs. The symptoms are
obscure (`cannot import name ...`), so the command line checks before anything else and says
what happened in one line. Pure stdlib and file checks only: this must run even when half of
either package is missing.
"""

from __future__ import annotations

from pathlib import Path

# Files of the file-events package (watchdog 2.x - 7.x); none of them is ours.
OTHER_PACKAGE_FILES = ("events.py", "observers", "watchmedo.py")
OURS_MARKER = "__hbm_watchdog__"

ADVICE = ("install hbm-watchdog into a virtual environment of its own "
          "(python -m venv .venv && .venv/bin/pip install hbm-watchdog), "
          "or remove both and reinstall hbm-watchdog alone")


def name_clash() -> str | None:
    """A one-line explanation when this environment's `watchdog` package is not ours alone, else None."""
    import watchdog

    folders = [Path(p) for p in getattr(watchdog, "__path__", [])]
    foreign = sorted({name for folder in folders for name in OTHER_PACKAGE_FILES if (folder / name).exists()})
    if not getattr(watchdog, OURS_MARKER, False):
        return ("the import package 'watchdog' in this environment is not hbm-watchdog's "
                f"(it is the file-events package 'watchdog', installed over it); {ADVICE}")
    if foreign:
        return (f"the file-events package 'watchdog' ({', '.join(foreign)}) is installed in the same "
                f"'watchdog' folder as hbm-watchdog, which shares its import name; {ADVICE}")
    return None

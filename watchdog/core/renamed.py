"""Python names renamed, kept for one release: a module's `__getattr__` that hands the old name the
new object with a DeprecationWarning saying what to write instead (the command line's renamed
options are `commands/renamed.py`'s; the CHANGELOG lists both)."""

from __future__ import annotations

import warnings
from typing import Any, Callable


def old_names(module: str, renamed: dict[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """`__getattr__ = old_names(__name__, {"old": ("where.to.find.new", new_object)})`."""

    def __getattr__(name: str) -> Any:
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        use, value = renamed[name]
        warnings.warn(f"{name} is deprecated; use {use}", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__

"""A module's old name, kept for one release after it moved: the same module object under both
names (its state, its patches), and a deprecation line for whoever imports the old one.
Shared by every layer that kept an old name; imports nothing of ours but by name."""

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make the module being imported as `old` the module `new`, and say so once per import."""
    module = importlib.import_module(new)
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=3)
    sys.modules[old] = module

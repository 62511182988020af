"""Byte sizes as people write them (`512MiB`, `3GiB`, `1048576`) and as logs print them."""

from __future__ import annotations

import re

from watchdog.core.errors import InputError

_BINARY = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size in bytes; raises ValueError with a message naming the bad text."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes or a suffix such as 512MiB, 3GiB)")
    number, unit = match.groups()
    factor = _BINARY.get(unit.lower()) or _DECIMAL.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use KiB, MiB, GiB, TiB)")
    return int(float(number) * factor)


def memory_limit_option(text: str | None, flag: str = "--memory-limit") -> int | None:
    """A command-line memory budget: None when not given, else positive bytes (InputError if not)."""
    if text is None:
        return None
    try:
        limit = parse_size(text)
    except ValueError as exc:
        raise InputError(f"{flag}: {exc}") from None
    if limit <= 0:
        raise InputError(f"{flag}: must be a positive number of bytes")
    return limit


def format_bytes(n: float | None, digits: int = 1) -> str:
    """`1536` -> `1.5 KiB` (`digits` after the point); signed, so it also prints slopes."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    if value < 1024:
        return f"{sign}{value:.0f} B"
    power = min(len(_UNITS) - 1, (int(value).bit_length() - 1) // 10)  # explanations format a few per bucket
    return f"{sign}{value / (1 << 10 * power):.{digits}f} {_UNITS[power]}"


def format_duration(seconds: float) -> str:
    """`8.2` -> `8 s`, `300` -> `5 min`, `9000` -> `2.5 h`: a duration as a person reads it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

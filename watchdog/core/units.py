"""Byte sizes as people write them (`512MiB`, `3GiB`, `1048576`) and as logs print them.

A size is ASCII digits, an optional fraction and an optional unit, and is below `MAX_SIZE`
(8 EiB): the rules of `watchdog.core.numbers`. It is computed in integers, so a 400-digit size is
refused as too large instead of overflowing a float.
"""

from __future__ import annotations

import re

from watchdog.core.errors import InputError
from watchdog.core.numbers import MAX_SIZE, shown

_BINARY = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_SIZE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*", re.ASCII)  # [0-9]: no other script's digits
_FRACTION_DIGITS = 12  # a TiB's 2**40 bytes: 12 decimals resolve every byte of one


def parse_size(text: str | int) -> int:
    """A size in bytes, 0 to MAX_SIZE - 1; InputError naming the bad text otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text < MAX_SIZE:
            raise InputError(f"size must be from 0 to {MAX_SIZE - 1:,} bytes, got {text}")
        return text
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise InputError(f"not a size: {shown(str(text))} (use bytes or a suffix such as 512MiB, 3GiB)")
    whole, fraction, unit = match.groups()
    factor = _BINARY.get(unit.lower()) or _DECIMAL.get(unit.lower())
    if factor is None:
        raise InputError(f"unknown size unit {unit!r} in {shown(str(text))} (use KiB, MiB, GiB, TiB)")
    whole = whole.lstrip("0") or "0"
    fraction = (fraction or "")[:_FRACTION_DIGITS]
    if len(whole) > len(str(MAX_SIZE)):  # before int(): thousands of digits are too large, not int()'s problem
        raise InputError(f"size {shown(str(text))} is too large: sizes are below 8 EiB (2**63 bytes)")
    scale = 10 ** len(fraction)
    value = (int(whole) * scale + int(fraction or "0")) * factor // scale
    if value >= MAX_SIZE:
        raise InputError(f"size {shown(str(text))} is too large: sizes are below 8 EiB (2**63 bytes)")
    return value


def positive_size(text: str) -> int:
    """A memory budget (`--memory-limit`): a size of at least one byte."""
    size = parse_size(text)
    if size <= 0:
        raise InputError(f"must be a positive number of bytes, got {shown(str(text))}")
    return size


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


def format_limit(n: float | None) -> str:
    """A budget as its user wrote it: `2.75 GiB` (one decimal read 2.8 GiB), `16.0 GiB`, `1.5 GiB`."""
    two = format_bytes(n, 2)
    return format_bytes(n, 1) if two.split()[0].endswith("0") else two


def format_duration(seconds: float) -> str:
    """`8.2` -> `8 s`, `0.4` -> `0.4 s`, `300` -> `5 min`, `9000` -> `2.5 h`: a duration as a person reads it."""
    if 0 < seconds < 1:  # a sub-second interval is not "0 s"
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

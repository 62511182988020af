"""Whole numbers from people and files (steps, sizes, PIDs, seeds, counts): ASCII digits, bounded.

Python's own parsing is too generous for numbers that name something: `int()` reads any Unicode
decimal digit (`'١'` is 1, `'５'` is 5), `str.isdigit()` also passes superscripts that `int()`
then refuses (`'²'`), and neither bounds the value. A PID file holding `١` would name init; a
400-digit size overflows the float arithmetic behind every projection; a step of 2**60 makes
neighbouring steps the same float and a slope a division by zero. So every such number goes
through `whole_number`: the digits 0-9 and nothing else (no sign, no `_`, no spaces inside), a
value within documented bounds, and anything else one `InputError` (one line, exit status 2).
Sizes with their suffixes are `watchdog.core.units.parse_size`, built on the same rules.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, TypeVar

from watchdog.core.errors import InputError

MAX_STEP = 2**52
"""Steps (and counts of steps or samples) are below this: a step, and the midpoint of two steps
(the detector's bucket centres), are then exact floats, so two different steps never compare equal."""
MAX_SIZE = 2**63
"""Sizes in bytes are below this (8 EiB): a signed 64-bit byte count, what every runtime reports."""
PID_MAX = 2**22
"""PIDs are below this: the kernel's pid_max can be raised to 2**22 (PID_MAX_LIMIT) and no further."""
SEED_MAX = 2**32 - 1
"""Seeds are at most this: numpy's generators take 0 .. 2**32 - 1."""
PORT_MAX = 65535
MAX_SECONDS = 10**9
"""Durations (`watch`'s seconds) are at most this (about 31 years): any wait or margin a person means."""
MIN_INTERVAL = 1e-4
"""A sampling interval is at least this: a duration over an interval, a count of samples, then stays
below 10**13, far inside MAX_STEP (`--interval 5e-324` made 60 s a sample count of infinity)."""

_DIGITS = re.compile(r"[0-9]+")  # not \d, which matches every script's digits
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")  # ASCII; no sign, no inf/nan
_SHOWN = 40  # characters of a bad value worth quoting back

T = TypeVar("T")


def shown(text: str) -> str:
    """A bad value as an error message quotes it: repr'd, and cut short (a 5,000-digit PID is one line)."""
    return repr(text) if len(text) <= _SHOWN else repr(text[:_SHOWN]) + f"... ({len(text):,} characters)"


def whole_number(text: str, what: str, low: int, high: int) -> int:
    """`text` (surrounding spaces aside) as an integer from `low` to `high`, else InputError.

    `what` names the number for the message ("a step", "a PID"). The length is checked before
    `int()` is called, so a 5,000-digit string is refused as too large, not by `int()`'s own limit.
    """
    digits = text.strip()
    if not _DIGITS.fullmatch(digits):
        raise InputError(f"expected {what} written in the digits 0-9, got {shown(text)}")
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(high)) or not low <= (value := int(significant)) <= high:
        raise InputError(f"expected {what} from {low:,} to {high:,}, got {shown(text)}")
    return value


def parse_step(text: str) -> int:
    """A training step (or sample number): 0 to MAX_STEP - 1."""
    return whole_number(text, "a step", 0, MAX_STEP - 1)


def parse_count(text: str) -> int:
    """A count of steps, samples or restarts that may be zero: bounded like a step."""
    return whole_number(text, "a whole number", 0, MAX_STEP - 1)


def parse_positive(text: str) -> int:
    """A count that must be at least 1 (steps between samples, batch size, repeats)."""
    return whole_number(text, "a positive whole number", 1, MAX_STEP - 1)


def parse_seed(text: str) -> int:
    """A random seed, as numpy takes it: 0 to 2**32 - 1."""
    return whole_number(text, "a seed", 0, SEED_MAX)


def parse_pid(text: str) -> int:
    """A process to watch or signal: 2 to PID_MAX - 1. PID 1 is init (signalling it would take the
    machine or the container down with it) and 0 is no process at all (to kill(), the caller's group)."""
    pid = whole_number(text, "a PID", 0, PID_MAX - 1)
    if pid < 2:
        raise InputError(f"PID {pid} is {'init' if pid else 'no process'}: not a process to watch or signal")
    return pid


def parse_port(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    return whole_number(text, "a port", 0, PORT_MAX)


def decimal(text: str, what: str, low: float, high: float, *, below: bool = False) -> float:
    """`text` as a number from `low` to `high` (`below`: `high` itself excluded), written in ASCII
    (`90`, `0.5`, `2e-3`), else InputError. No sign, `inf` or `nan`; the length is checked before
    `float()`."""
    written = text.strip()
    if len(written) > _SHOWN or not _DECIMAL.fullmatch(written):
        raise InputError(f"expected {what} written in the digits 0-9 (e.g. 90, 0.5), got {shown(text)}")
    value = float(written)
    if not low <= value <= high or (below and value >= high):
        upper = f"below {high:,g}" if below else f"{high:,.0f}" if high >= 1000 else f"{high:g}"
        raise InputError(f"expected {what} from {low:g} to {upper}, got {shown(text)}")
    return value


def parse_seconds(text: str) -> float:
    """A duration in seconds (a wait, a margin, a grace period): 0 to MAX_SECONDS."""
    return decimal(text, "a number of seconds", 0.0, MAX_SECONDS)


def parse_interval(text: str) -> float:
    """Seconds between samples: MIN_INTERVAL to MAX_SECONDS."""
    return decimal(text, "an interval in seconds", MIN_INTERVAL, MAX_SECONDS)


def bounds(low: float, high: float, *, below: bool = False) -> Callable[[Callable[[str], T]], Callable[[str], T]]:
    """A parser's range, kept on it (`low`, `high`, `below`: `high` excluded; ints for whole numbers,
    floats for decimals), so that a test can try every option just outside it
    (tests/test_bench_options.py)."""

    def keep(parse: Callable[[str], T]) -> Callable[[str], T]:
        parse.low, parse.high, parse.below = low, high, below  # type: ignore[attr-defined]
        return parse

    return keep


def whole_in(low: int, high: int, what: str = "a whole number") -> Callable[[str], int]:
    """A parser of whole numbers from `low` to `high` (`whole_number`'s rules), its range kept on it."""
    return bounds(low, high)(lambda text: whole_number(text, what, low, high))


def decimal_in(low: float, high: float, what: str = "a number", *, below: bool = False) -> Callable[[str], float]:
    """A parser of decimal numbers from `low` to `high` (`decimal`'s rules), its range kept on it."""
    return bounds(float(low), float(high), below=below)(lambda text: decimal(text, what, low, high, below=below))


for _parse, _low, _high in ((parse_step, 0, MAX_STEP - 1), (parse_count, 0, MAX_STEP - 1),
                            (parse_positive, 1, MAX_STEP - 1), (parse_seed, 0, SEED_MAX), (parse_pid, 2, PID_MAX - 1),
                            (parse_port, 0, PORT_MAX), (parse_seconds, 0.0, float(MAX_SECONDS)),
                            (parse_interval, MIN_INTERVAL, float(MAX_SECONDS))):
    bounds(_low, _high)(_parse)


def option(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse `type=`: its InputError becomes argparse's refusal (exit status 2),
    message kept (argparse would otherwise replace a ValueError's message with its own). The
    parser's range, where it keeps one (`bounds`), is kept on the option too."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "number")
    for name in ("low", "high", "below"):
        if hasattr(parse, name):
            setattr(convert, name, getattr(parse, name))
    convert.checked = True  # type: ignore[attr-defined] - made here: refusals are one line, exit 2
    return convert


def check_settings(settings: object, prefix: str = "") -> None:
    """Every int or float field of a configuration dataclass holds a number of its kind, checked
    before its own ranges: an int field an int and never a bool (True is an int: a 1-byte budget),
    a float field a finite int or float (inf overflowed a timer), both within 64 bits. A field
    that may be None may be None. ConfigError naming the field (`prefix.name`) otherwise. The one
    copy of this rule: `WatchdogConfig`, `PolicyConfig`, `DetectorConfig` and `RecompilationConfig`
    call it first."""
    import dataclasses
    import math

    from watchdog.core.errors import ConfigError

    for field in dataclasses.fields(settings):
        parts = {part.strip() for part in str(field.type).split("|")}
        if not parts & {"int", "float"} or not parts <= {"int", "float", "None"}:
            continue  # not a plain number (a bool, a string, a tuple of pairs): its own checks
        kind = str(field.type)
        value = getattr(settings, field.name)
        if value is None and "None" in kind:
            continue
        name = f"{prefix}.{field.name}" if prefix else field.name
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"must be a number, got {value!r}")
        if "float" not in kind and not isinstance(value, int):
            raise ConfigError(name, f"must be an integer, got {value!r}")
        if not math.isfinite(value) or abs(value) >= 2**63:
            raise ConfigError(name, f"must be a finite number below 2**63, got {value!r}")

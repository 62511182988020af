"""JSON in and out, total: bounded reading of files from outside, strict writing. Pure.

Python's `json` is generous both ways. Reading, it follows nesting with the C stack (2,000 `[`
raise RecursionError, not ValueError), turns a 4,000-digit integer into an int that overflows
the first float it meets, reads `1e400` as infinity, and accepts `NaN` and `Infinity`, which no
other parser does. Writing, it prints `Infinity` and `NaN` for non-finite floats, which strict
parsers (jq, JavaScript's JSON.parse, Go) refuse.

- `loads(text)`: a value whose integers lie in the signed 64-bit range, whose floats are finite,
  and whose nesting is at most `MAX_DEPTH`; `NaN` and `Infinity` (what this project's writers
  printed before they were strict) read as null, as `dumps` writes them now. Anything else is a
  `JsonProblem` (a ValueError) saying what, with the line where the text says so; callers add the
  file's name, never its text.
- `dumps(value)`: strict JSON: every non-finite float is null (`allow_nan=False` behind it, so a
  value that escaped is an error here, never a bad line there). Every `--json` output, the flight
  record and the job file are written through it.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32
"""Nesting this project's files need: a flight record's `host` -> `verdict` is 3 deep."""
MAX_INT_DIGITS = 19
"""Digits of the largest integer read (2**63 - 1 has 19); longer ones are refused before `int()`."""
_INT_LOW, _INT_HIGH = -(2**63), 2**63 - 1


class JsonProblem(ValueError):
    """A text that is not JSON this project reads; `line` is where, when the text says (1-based)."""

    def __init__(self, problem: str, line: int | None = None):
        super().__init__(problem)
        self.problem, self.line = problem, line


def _int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > MAX_INT_DIGITS or not _INT_LOW <= (value := int(text)) <= _INT_HIGH:
        raise JsonProblem(f"an integer out of range ({len(digits):,} digits; at most 2**63 - 1)")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonProblem(f"a number out of range ({len(text):,} characters, not a finite float)")
    return value


def _constant(_name: str) -> None:
    return None  # NaN, Infinity, -Infinity: not JSON; what the writers printed for "no number"


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """`text` as JSON, bounded as the module says; JsonProblem otherwise."""
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except JsonProblem:
        raise
    except RecursionError:
        raise JsonProblem(f"nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise JsonProblem("not JSON", exc.lineno) from None
    except (ValueError, TypeError):  # bytes not UTF-8, or what json itself refuses otherwise
        raise JsonProblem("not JSON") from None
    if depth(value) > max_depth:
        raise JsonProblem(f"nested deeper than {max_depth} levels")
    return value


def depth(value: Any) -> int:
    """How deeply containers nest in `value` (a scalar: 0), without recursion: linear in its size."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def finite(value: Any) -> Any:
    """`value` with every non-finite float (inf, nan) replaced by None, in dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON: non-finite floats as null (see `finite`); `options` as `json.dumps` takes them."""
    return json.dumps(finite(value), allow_nan=False, **options)

"""What grows when Python objects pile up: the container whose own size grows with them, and the
record each of its entries is.

A cache of small objects grows by many types at once: a dict keyed by each step's scalar whose
values are tuples of frozen dataclasses, themselves holding tuples (pytorch/torchtitan#3790's
sharding specs). Named by its most numerous type and that type's innermost holder, it read "+472,016
Python objects tuple; held by attribute 'placements' of DTensorSpec", which says nothing a person
can change. What a person changes is the container that grows, and the attribute that holds it.

So the climb starts at instances of a type that grew, and goes up through whatever holds them
(instances, their slots, tuples) to the first list, dict, deque or set (a module's globals
included) whose size grew with them: its newest entry holds objects of the grown type of its own
(not shared with the entry before it), and it gained, since the baseline, at least half as many
entries as the growth makes at that many objects an entry. The baseline keeps the size of every
list, dict and deque of `census.SIZED` entries or more (one `len` per container in the walk it
makes anyway); one it does not know had fewer. A small container met first (each record's own
list of parts) fails the second test, and so does one as large at the baseline, and the climb
goes on above it.

The record is told by its newest entry: a tuple by its items' types, `(Plan, Spec)`; anything else
by its type, a namedtuple or a dataclass by its name. Its size is what that entry holds that the
entry before it does not share (interned strings and small numbers, a mesh every spec refers to,
are left out), and its share of the container.

Every object is looked at through `peek`: none of the program's code runs.
"""

from __future__ import annotations

import gc
import types
from collections import deque
from dataclasses import dataclass

from watchdog.forensics import peek

MAX_LEVELS = 8  # holders climbed through (a tuple, a dataclass, its tuple, the value tuple, the dict: 4)
MAX_FRONTIER = 16  # objects climbed from per level (gc.get_referrers compares each referent with each)
RECORD_OBJECTS = 4096  # objects read from one entry, at most
RECORD_DEPTH = 5
WIDE = 1024  # a container wider than this inside an entry is not looked into (a table the records share)
_GROWING = (dict, list, deque, set)


@dataclass(frozen=True)
class Records:
    container: object  # the list, dict, deque or set that grows
    grew: int  # entries it gained since the baseline
    record: str  # "(DTensorSpec, DTensorSpec)", "Plan"
    entry_bytes: int  # what one entry holds of its own, and its share of the container
    per_entry: dict  # id(type) -> its objects in one entry that the collector lists: the types it explains


def grown_records(samples: list, kind: type, added: int, referrers, sizes: dict[int, int]) -> Records | None:
    """The container that grows with the `added` instances of `kind`, climbing from `samples` of them
    with `referrers(objects) -> list` (the namer's: it leaves the forensics' own lists out); `sizes`
    are the baseline's sizes of its large containers (a container not among them had fewer entries).

    The samples are spread over every instance (the type grew by at least half its number at the
    baseline, so a third of them or more are new), and each container that passes is credited
    with the samples it was reached from: the one most are held by wins, once it holds half of
    them or the climb ends. So a few samples from before the baseline, or from a container of
    the program's that is not the leak, do not decide."""
    samples = samples[:MAX_FRONTIER]
    reached: dict[int, set] = {id(s): {i} for i, s in enumerate(samples)}  # id -> the samples that reach it
    passed: dict[int, tuple[Records, set]] = {}
    frontier = list(samples)
    ours = {id(reached), id(passed), id(frontier), id(samples)}
    for _ in range(MAX_LEVELS):
        if not frontier:
            break
        ids, climb = {id(o) for o in frontier}, []
        ours.update((id(frontier), id(climb)))
        for ref in referrers(frontier):
            ref_kind = type(ref)
            if (id(ref) in ours or ref_kind is types.FunctionType or ref_kind is types.CellType
                    or peek.derives(ref_kind, type)):
                continue
            came = set()
            for child in gc.get_referents(ref):
                if id(child) in ids:
                    came |= reached[id(child)]
            if not came:
                continue
            if id(ref) in reached:  # met before: more samples reach it
                reached[id(ref)] |= came
                if id(ref) in passed:
                    passed[id(ref)][1].update(came)
                continue
            reached[id(ref)] = came
            if peek.container_base(ref_kind) in _GROWING:
                records = _judged(ref, kind, added, sizes)
                if records is not None:
                    passed[id(ref)] = (records, came)
                    continue
            climb.append(ref)
        best = max(passed.values(), key=lambda p: (len(p[1]), peek.length(p[0].container)), default=None)
        if best is not None and len(best[1]) * 2 >= len(samples):
            return best[0]
        frontier = climb[:MAX_FRONTIER]
    best = max(passed.values(), key=lambda p: (len(p[1]), peek.length(p[0].container)), default=None)
    return best[0] if best is not None else None


def spread(instances: list, count: int = MAX_FRONTIER) -> list:
    """`count` of `instances`, evenly spaced from the newest back."""
    step = max(1, len(instances) // count)
    return instances[::-1][::step][:count]


def _judged(container, kind: type, added: int, sizes: dict[int, int]) -> Records | None:
    """`container`'s records, when it is the one that grew with `added` objects of `kind`."""
    is_dict = peek.container_base(type(container)) is dict
    newest, older = _last_two(container)
    if newest is None:
        return None
    shared = set(_reach(older if is_dict else (older,), set())) if older is not None else set()
    own = _reach(newest if is_dict else (newest,), shared)
    per_entry: dict[int, int] = {}
    for obj in own.values():
        if _stays_tracked(obj):  # as the census counts them
            per_entry[id(type(obj))] = per_entry.get(id(type(obj)), 0) + 1
    if not per_entry.get(id(kind)):
        return None  # its newest entry holds none of what grew: not the container that grows with it
    size = peek.length(container)
    grew = size - sizes.get(id(container), 0)
    if grew * 2 < added // per_entry[id(kind)]:
        return None  # it did not grow with them: one record's own part list, or a container as large before
    key, value = newest if is_dict else (None, newest)
    holds = value if key is None or any(type(o) is kind for o in _reach((value,), shared).values()) else key
    entry_bytes = sum(map(peek.shallow_size, own.values())) + peek.shallow_size(container) // max(size, 1)
    return Records(container, grew, record_words(holds), entry_bytes, per_entry)


def _stays_tracked(obj) -> bool:
    """Whether the garbage collector will list `obj` once a collection has looked at it: a tuple or a
    dict whose items are all untracked is untracked then (the newest entries' may not be yet, while
    the census counted the older ones without theirs)."""
    if not gc.is_tracked(obj):
        return False
    kind = type(obj)
    if kind is tuple:
        return any(map(gc.is_tracked, tuple.__iter__(obj)))
    if kind is dict:
        return any(gc.is_tracked(key) or gc.is_tracked(value) for key, value in dict.items(obj))
    return True


def _last_two(container) -> tuple:
    """The newest entry and the one before it: a dict's newest (key, value) pairs in insertion
    order, a list's or a deque's last items, two items of a set. (None, None) when empty."""
    base = peek.container_base(type(container))
    if base is dict:
        last = reversed(dict.items(container))
    elif base is list:
        last = list.__reversed__(container)
    elif base is deque:
        last = deque.__reversed__(container)
    else:
        last = set.__iter__(container)
    newest = next(last, None)
    return newest, next(last, None)


def _reach(starts, shared: set) -> dict[int, object]:
    """id -> object for what `starts` hold, breadth first, not through anything in `shared` (the ids
    the entry before it holds), a type, a module, a function, or a wide container."""
    found: dict[int, object] = {}
    level = list(starts)
    for _ in range(RECORD_DEPTH):
        below = []
        for obj in level:
            if id(obj) in found or id(obj) in shared or len(found) >= RECORD_OBJECTS:
                continue
            found[id(obj)] = obj
            kind = type(obj)
            if (peek.derives(kind, type) or peek.derives(kind, types.ModuleType) or kind is types.FunctionType
                    or (peek.container_base(kind) is not None and peek.length(obj) > WIDE)):
                continue
            below.extend(gc.get_referents(obj))
        level = below
    return found


def record_words(entry) -> str:
    """`(Plan, Spec)` for a plain tuple (its first items' types), `list of 100 Event` for a list,
    a deque or a set (its first item's type), else the entry's type's name."""
    kind = type(entry)
    if kind is tuple:
        parts = [peek.short_name(type(item)) for item in tuple.__iter__(entry)]
        shown = parts[:4] + (["..."] if len(parts) > 4 else [])
        return f"({', '.join(shown)})"
    base = peek.container_base(kind)
    if base is not None and base is not dict and base is not tuple:
        first = next(iter(peek.items(entry)), None)
        of = f" {peek.short_name(type(first))}" if first is not None else ""
        return f"{peek.short_name(kind)} of {peek.length(entry):,}{of}"
    return peek.short_name(kind)

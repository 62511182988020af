"""What is leaking: a census of what keeps device memory alive, diffed against a baseline.

The census reads metadata only (shapes, dtypes, devices, autograd nodes, hook tables, XLA debug
counters): no device sync, no transfer, no compilation. It walks the garbage collector's objects,
so it costs milliseconds to seconds: it runs on the training thread between steps, once after the
first step (the baseline) and when a leak is being explained, never inside a step.

It counts, and `explain_leak` names what grew since the baseline:

- live tensors by group (device, dtype, shape, whether they hold an autograd graph): a list that
  keeps a tensor per step shows as one group growing, and `holders` names the list's owner;
- large Python buffers in host memory (bytes, bytearray, NumPy arrays that own their data, of
  `MIN_BUFFER_BYTES` or more) held by a list, a dict, a deque or an attribute of an instance of
  one of the program's classes (`_AttributeHolders`), grouped by type and size the
  same way: what the host's memory leaks when it is not tensors (a cache of encoded samples, a
  checkpointer's staging copies);
- the autograd graphs live tensors keep alive, with the bytes of the tensors saved for backward
  (`autograd_graphs`): `total_loss += loss` keeps one scalar and every step's activations;
- the graphs hanging off parameters' `.grad` (`backward(create_graph=True)` never reset);
- module hooks per module: a hook registered every step and never removed;
- tensors larger than any at the baseline: a tensor concatenated onto every step;
- on XLA, syncs and traced IR nodes (`xla_activity.activity`): a loop that never syncs piles its
  whole run onto one pending graph on the host, and new compilations (shapes that change);
- Python objects by type (those the garbage collector tracks), counted in C in the same walk: when
  no group of tensors or buffers grew, what grew is named as the container that grows, with one
  of its entries as the record that piles up (`records`): "about +118,000 entries of
  (DTensorSpec, DTensorSpec) in dict '_cache' of FusedAdamW" (fused AdamW under FSDP2 kept
  `DTensorSpec`s, 0.5 MB a step of host RAM: pytorch/torchtitan#3790; the census said "nothing
  found", then named the innermost holder of the commonest type, a spec's `placements`).

Every census is total: it looks at objects only through `peek` (no property, no `__getattr__`, no
`__class__`, no import, no hash of a type: none of the program's code runs), and what it cannot
read (a tensor with no tensor behind it) is left out and counted in `unread`, never raised.

With a `CreationSites` capture that ran since, each line also says where Python created the
tensors: "+300 tensors float32[1048576] on xla:0 (+1.2 GiB), created at leaks.py:97 in _filled;
held by list of 302 (attribute 'tensors' of LeakSinks)".
"""

from __future__ import annotations

import gc
import os
import re
import types
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from watchdog.core.units import format_bytes
from watchdog.forensics import peek, records, xla_activity
from watchdog.forensics.autograd_graphs import GraphSize, GraphWalker, buffer_key
from watchdog.forensics.holders import MODULE_HOOKS, Namer, module_paths, parameter_names

if TYPE_CHECKING:
    from watchdog.forensics.creation_sites import CreationSites

MORE_LINES = 3  # beyond `top` tensor groups: graph roots, .grad, hooks, XLA
MIN_GRAPH_BYTES = 1 << 20  # graph growth below this is noise (a step's loss with its graph)
MIN_GRAPH_NODES = 1000  # ... unless its nodes pile up (a graph backpropagated, then kept)
MIN_PENDING_IR_NODES = 1000
MIN_NEW_COMPILATIONS = 5  # a few graphs compile late in any run (the first eval, the last short batch)  # traced without a sync since the baseline: more than any one step
MIN_BUFFER_BYTES = 64 << 10  # smaller Python buffers are the interpreter's own business
PYTHON_BUFFERS = "host"  # the `device` of a group of Python buffers (CPU tensors say "cpu")
_GLOBAL_HOOKS = {f"_global{name}": words for name, words in MODULE_HOOKS.items()}


@dataclass(frozen=True, slots=True, order=True)
class TensorGroup:
    device: str
    dtype: str
    shape: tuple[int, ...]
    has_graph: bool  # a tensor with grad_fn keeps its whole autograd graph alive

    def describe(self, graph: bool = False) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        if self.device == PYTHON_BUFFERS:
            return f"{self.dtype}[{shape}] in host memory"
        return f"{self.dtype}[{shape}] on {self.device}" + (" with autograd graph" if graph and self.has_graph else "")


@dataclass
class Census:
    count: Counter = field(default_factory=Counter)  # TensorGroup -> live tensors
    nbytes: Counter = field(default_factory=Counter)  # TensorGroup -> their bytes
    graphs: GraphSize = GraphSize()  # every autograd graph reachable from live tensors and .grad
    grad_graphs: GraphSize = GraphSize()  # the part reachable from parameters' .grad
    hooks: Counter = field(default_factory=Counter)  # (module path, kind of hook) -> hooks
    largest_tensor_bytes: int = 0
    xla: xla_activity.XlaActivity | None = None
    types: Counter = field(default_factory=Counter)  # id(type) -> sampled instances the garbage collector tracks
    sizes: dict = field(default_factory=dict)  # id -> entries, of the lists, dicts and deques of SIZED or more
    kinds: dict = field(default_factory=dict)  # id(type) -> the type (kept alive: its id stays its own)
    unread: Counter = field(default_factory=Counter)  # type name -> objects that could not be read


@dataclass(frozen=True)
class Growth:
    group: TensorGroup
    added_tensors: int
    added_bytes: int
    holders: tuple[str, ...] = ()

    def describe(self) -> str:
        held = f"; held by {', '.join(self.holders)}" if self.holders else ""
        noun = "Python buffers" if self.group.device == PYTHON_BUFFERS else "tensors"
        return (f"+{self.added_tensors} {noun} {self.group.describe(graph=True)} "
                f"(+{format_bytes(self.added_bytes)}){held}")


def group_of(tensor) -> TensorGroup:
    """A tensor's or a buffer's group (inside `peek.reading_tensors()`)."""
    kind = type(tensor)
    if kind is bytes or kind is bytearray:
        return TensorGroup(PYTHON_BUFFERS, peek.short_name(kind), (len(tensor),), False)
    reads = peek.tensor_reads()
    if reads is None or not peek.derives(kind, reads.tensor):  # a NumPy array
        return TensorGroup(PYTHON_BUFFERS, f"numpy.{tensor.dtype}", tuple(tensor.shape), False)
    return TensorGroup(str(reads.device(tensor)), str(reads.dtype(tensor)).replace("torch.", ""),
                       tuple(reads.shape(tensor)), reads.grad_fn(tensor) is not None)


def _size(tensor) -> int:
    kind = type(tensor)
    if kind is bytes or kind is bytearray:
        return len(tensor)
    reads = peek.tensor_reads()
    if reads is None or not peek.derives(kind, reads.tensor):
        return int(tensor.nbytes)
    return reads.size(tensor)


def _grad_fn(obj):
    """A tensor's `grad_fn` (None for a buffer, or where it cannot be read)."""
    reads = peek.tensor_reads()
    if reads is None or not peek.derives(type(obj), reads.tensor):
        return None
    try:
        return reads.grad_fn(obj)
    except Exception:  # noqa: BLE001 - a tensor with no tensor behind it
        return None


def _python_buffers(containers: list, held_by: dict[int, object] | None = None) -> list:
    """Large bytes, bytearrays and data-owning NumPy arrays that lists, dicts and deques hold.
    Buffers are not tracked by the garbage collector, so they are found through their holders:
    their referents, asked for a few thousand holders at a time (one C call each, not one per
    holder: it keeps this part of a census to about the cost of the tensor walk). A dict that holds
    nothing but buffers and numbers is untracked too (CPython stops tracking such dicts: a cache
    `{step: bytearray}` was never found), so dicts of `_UNTRACKED_ENTRIES` or more that the holders
    hold and the collector does not track are looked into as well, one level down (the small ones,
    records of numbers and strings, are most untracked dicts; a cache that leaks grows past that),
    each on its own: `held_by` gets, for each buffer found in one, that dict, which the
    collector's referrers never name."""
    found: dict[int, object] = {}
    untracked: dict[int, dict] = {}
    for start in range(0, len(containers), _REFERENTS_CHUNK):
        _buffers_among(gc.get_referents(*containers[start:start + _REFERENTS_CHUNK]), found, untracked)
    for holder in untracked.values():
        inside: dict[int, object] = {}
        _buffers_among(gc.get_referents(holder), inside, None)
        found.update(inside)
        if held_by is not None:
            held_by.update(dict.fromkeys(inside, holder))
    return list(found.values())


def _buffers_among(items: list, found: dict[int, object], untracked: dict[int, dict] | None) -> None:
    """The large buffers among `items` into `found`; with `untracked`, the untracked dicts among them too."""
    ndarray = peek.module_global("numpy", "ndarray")
    for item in items:
        kind = type(item)
        if kind is bytes or kind is bytearray:
            if len(item) >= MIN_BUFFER_BYTES:
                found[id(item)] = item
        elif ndarray is not None and kind is ndarray and item.base is None and item.nbytes >= MIN_BUFFER_BYTES:
            found[id(item)] = item
        elif (untracked is not None and kind is dict and len(item) >= _UNTRACKED_ENTRIES
              and not gc.is_tracked(item)):
            untracked[id(item)] = item


_REFERENTS_CHUNK = 4096
_UNTRACKED_ENTRIES = 16


MANY_INSTANCES = 4096
_OTHER, _CONTAINER, _SUBCLASSED, _TENSOR, _MODULE, _ATTRIBUTES = range(6)  # what the walk does with a type's objects
SIZED = 64  # a list, dict or deque of this many entries or more has its size kept: what grew since is told


class _Roles(dict):
    """id(type) -> what the walk does with its instances, decided once per type from its MRO (by
    identity: `peek`), never from the instance: a list, dict or deque (searched for buffers; a
    subclass's length read by its builtin base), a tensor, an nn.Module, an instance whose
    attributes are searched for buffers, or nothing.

    Attributes are looked into for a Python class's instances (a heap type with a `__dict__` or
    slots) of at most `MANY_INSTANCES` instances: in CPython 3.11+ an instance keeps its attributes
    inline, and a `__slots__` class in its slots, so a cache held straight as `self.cache` is no
    referent of any list, dict or deque; the objects a program has many of (records, specs) are
    left out, which bounds what this adds to a census. Classes and modules are not: their dicts
    are containers of their own."""

    def __init__(self, reads: peek.TensorReads | None, sampled: Counter):
        super().__init__()
        self._reads = reads
        self._sampled = sampled

    def decide(self, kind: type) -> int:
        self[id(kind)] = role = self._role(kind)
        return role

    def _role(self, kind: type) -> int:
        if kind is list or kind is dict or kind is deque:
            return _CONTAINER
        bases = peek.mro(kind)
        if any(b is list or b is dict or b is deque for b in bases):
            return _SUBCLASSED
        reads = self._reads
        if reads is not None:
            if any(b is reads.tensor for b in bases):
                return _TENSOR
            if any(b is reads.module for b in bases):
                return _MODULE
        if (peek.is_heap_type(kind) and not any(b is type or b is types.ModuleType for b in bases)
                and peek.has_attributes(kind) and self._sampled[id(kind)] * TYPE_STRIDE <= MANY_INSTANCES):
            return _ATTRIBUTES
        return _OTHER


class _Live:
    """One pass over the garbage collector's objects: tensors, parameters, modules, and the holders
    (lists, dicts, deques, instances of a program's own classes) whose referents are searched for
    Python buffers, and the sizes of the large lists, dicts and deques. Each object is told apart by
    its type alone (`_Roles`)."""

    def __init__(self):
        self.tensors: list = []
        self.parameters: list = []
        self.modules: list = []
        self.unread: Counter = Counter()  # type name -> objects left out because reading them raised
        self.sizes: dict[int, int] = {}  # id -> entries, of the lists, dicts and deques of SIZED entries or more
        containers: list = []
        reads = self.reads = peek.tensor_reads()
        objects = gc.get_objects()
        # Types counted over every TYPE_STRIDE-th object, in C: all of them added 30% to a census
        # (0.12 -> 0.156 s at 246,000 objects); a leak of 10,000 instances still shows by the hundreds.
        # Keyed by id: a type's hash is its metaclass's to define (and to make raise).
        sampled = list(map(type, objects[::TYPE_STRIDE]))
        self.types: Counter = Counter(map(id, sampled))
        self.kinds: dict[int, type] = dict(zip(map(id, sampled), sampled))
        roles = _Roles(reads, self.types)
        role_of = roles.get
        ours = {id(self), id(self.tensors), id(self.parameters), id(self.modules), id(objects), id(containers),
                id(sampled), id(self.kinds), id(roles), id(self.sizes)}
        sizes = self.sizes
        for obj, key in zip(objects, map(id, map(type, objects))):
            role = role_of(key)
            if role is None:
                role = roles.decide(type(obj))
            if role == _OTHER:
                continue
            if role == _CONTAINER:
                containers.append(obj)
                if len(obj) >= SIZED:
                    sizes[id(obj)] = len(obj)
            elif role == _SUBCLASSED or role == _ATTRIBUTES:
                containers.append(obj)
                if role == _SUBCLASSED and peek.length(obj) >= SIZED:
                    sizes[id(obj)] = peek.length(obj)
            elif role == _TENSOR:
                try:
                    reads.grad_fn(obj)  # raises on a tensor object with no tensor behind it
                    parameter = reads.is_parameter(obj)
                except Exception:  # noqa: BLE001 - it holds no memory to count (seen in CI with gloo)
                    self.unread[peek.type_name(type(obj))] += 1
                    continue
                (self.parameters if parameter else self.tensors).append(obj)
            else:
                self.modules.append(obj)
        self.held_by: dict[int, object] = {}  # a buffer's holder that the collector does not track
        self.buffers: list = _python_buffers([c for c in containers if id(c) not in ours], self.held_by)
        containers.clear()
        objects.clear()

    @property
    def counted(self) -> list:
        """What the groups count: tensors (parameters apart) and large Python buffers."""
        return self.tensors + self.buffers

    def ids(self) -> set[int]:
        return {id(self), id(self.tensors), id(self.parameters), id(self.modules), id(self.buffers), id(self.held_by)}

    def walker(self) -> GraphWalker:
        """A walker that leaves the parameters' own buffers out of the saved bytes."""
        return GraphWalker(_buffer_keys(self.parameters))

    def grads_with_graph(self) -> list:
        found = []
        for p in self.parameters:
            grad = self.reads.grad(p)
            if grad is not None and self.reads.grad_fn(grad) is not None:
                found.append(p)
        return found

    def grad_roots(self, parameters: list) -> list:
        """The graphs hanging off the parameters' `.grad`."""
        return [self.reads.grad_fn(self.reads.grad(p)) for p in parameters]

    def graph_tensors(self) -> list:
        """The live tensors (parameters apart) that have a `grad_fn`."""
        return [t for t in self.tensors if _grad_fn(t) is not None]


def _buffer_keys(tensors: Iterable) -> set:
    keys = set()
    for tensor in tensors:
        try:
            keys.add(buffer_key(tensor)[0])
        except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
            continue
    return keys


def _count_groups(tensors: list, result: Census, unread: Counter) -> None:
    for tensor in tensors:
        try:
            group, size = group_of(tensor), _size(tensor)
        except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
            unread[peek.type_name(type(tensor))] += 1
            continue
        result.count[group] += 1
        result.nbytes[group] += size
        result.largest_tensor_bytes = max(result.largest_tensor_bytes, size)


def _hook_count(attrs: dict | None, attribute: str) -> int:
    """How many hooks a hook table (a dict, or an OrderedDict) in `attrs` holds; 0 for anything else."""
    table = attrs.get(attribute) if attrs is not None else None
    return peek.length(table) if table is not None and peek.container_base(type(table)) is dict else 0


def _count_hooks(modules: list) -> Counter:
    hooks: Counter = Counter()
    paths = module_paths(modules)
    for module in modules:
        attrs = peek.attributes(module)
        for attribute, words in MODULE_HOOKS.items():
            count = _hook_count(attrs, attribute)
            if count:
                hooks[(paths.get(id(module), peek.short_name(type(module))), words)] += count
    torch_module = peek.loaded("torch.nn.modules.module")
    module_globals = torch_module.__dict__ if torch_module is not None else None
    for attribute, words in _GLOBAL_HOOKS.items():
        count = _hook_count(module_globals, attribute)
        if count:
            hooks[("every module (global)", words)] += count
    return hooks


def census() -> Census:
    """Count what keeps memory alive now. Parameters are left out of the groups: they are the
    model, not a leak; their `.grad` graphs are counted apart. Total: see the module's docstring."""
    with peek.reading_tensors():
        return _census()


def _census() -> Census:
    live = _Live()
    result = Census(unread=live.unread)
    _count_groups(live.counted, result, live.unread)
    walker = live.walker()
    result.grad_graphs = _walk_all(live.grad_roots(live.grads_with_graph()), walker, live.unread)
    rest = _walk_all(map(_grad_fn, live.graph_tensors()), walker, live.unread)
    result.graphs = result.grad_graphs + rest
    result.hooks = _count_hooks(live.modules)
    result.xla = _xla_activity(live.unread)
    result.types, result.kinds, result.sizes = live.types, live.kinds, live.sizes
    return result


def _xla_activity(unread: Counter) -> xla_activity.XlaActivity | None:
    try:
        return xla_activity.activity()
    except Exception:  # noqa: BLE001 - torch_xla's counters unreadable: the rest of the census stands
        unread["torch_xla counters"] += 1
        return None


def _walk_all(grad_fns: Iterable, walker: GraphWalker, unread: Counter | None = None) -> GraphSize:
    total = GraphSize()
    for grad_fn in grad_fns:
        try:
            total += walker.walk(grad_fn)
        except Exception:  # noqa: BLE001 - a graph node that cannot be read: the rest is counted
            if unread is not None:
                unread[f"autograd graph from {peek.short_name(type(grad_fn))}"] += 1
    return total


def growth(before: Census, after: Census, top: int = 3, min_tensors: int = 2) -> list[Growth]:
    """Groups that grew most in bytes between two censuses (pure: no gc walk)."""
    grown = []
    for group, count in after.count.items():
        added = count - before.count.get(group, 0)
        if added >= min_tensors:
            grown.append(Growth(group, added, after.nbytes[group] - before.nbytes.get(group, 0)))
    grown.sort(key=lambda g: (-g.added_bytes, g.group))
    return grown[:top]


@dataclass(eq=False)
class _Finding:
    """One line of the explanation; also the owner of the saved tensors its walk reached first."""

    rank: int  # 0: the XLA pending graph (nothing else matters until it syncs); 1: memory; 2: hooks; 3: compiles
    bytes_: int = 0  # what it holds, to order findings of one rank
    text: str = ""
    graph: GraphSize = GraphSize()
    shown: bool = True
    among: list[str] = field(default_factory=list)  # grown groups that are saved tensors of this graph

    def line(self) -> str:
        return self.text + "".join(f"; among its saved tensors {words}" for words in self.among)


class _Ledger:
    """Walks graphs for findings in turn, remembering which finding reached each saved buffer first."""

    def __init__(self, walker: GraphWalker):
        self._walker = walker
        self.owner: dict[object, _Finding] = {}

    def walk(self, grad_fns: Iterable, finding: _Finding) -> GraphSize:
        keys: list = []
        total = GraphSize()
        for grad_fn in grad_fns:
            try:
                total += self._walker.walk(grad_fn, keys)
            except Exception:  # noqa: BLE001 - a node that cannot be read: the rest of the graph is told
                continue
        self.owner.update(dict.fromkeys(keys, finding))
        finding.graph = total
        return total


def _key(tensor) -> object:
    try:
        return buffer_key(tensor)[0]
    except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
        return None


def explain_leak(baseline: Census, top: int = 3, sites: CreationSites | None = None,
                 unread: Counter | None = None) -> list[str]:
    """Census now, compare with the baseline, and say in log-ready lines what grew, what holds it
    and, with `sites`, where it was created. Most important first; empty when nothing grew.
    Total: each part of the explanation that cannot be made is left out, named in `unread`."""
    with peek.reading_tensors():
        return _explain(baseline, top, sites, Counter() if unread is None else unread)


def _explain(baseline: Census, top: int, sites: CreationSites | None, unread: Counter) -> list[str]:
    live = _Live()
    unread.update(live.unread)
    now = Census()
    counted = live.counted
    _count_groups(counted, now, unread)
    namer = Namer(ours=live.ids() | {id(counted)}, modules=live.modules)
    namer.adopt(live.held_by)
    grads = live.grads_with_graph()
    graph_tensors = live.graph_tensors()
    namer.ignore(grads, graph_tensors)

    # Every graph once: the census's totals, and which live tensors are themselves saved by a graph
    # (their Python objects outlive the forward pass, and no Python container holds them).
    survey = live.walker()
    now.grad_graphs = _walk_all(live.grad_roots(grads), survey, unread)
    now.graphs = now.grad_graphs + _walk_all(map(_grad_fn, graph_tensors), survey, unread)
    ledger = _Ledger(live.walker())  # then who owns what: .grad first, then groups, then roots

    def kept_by_python(tensor) -> bool:
        try:
            return not survey.saved_by_another(tensor)
        except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
            return True

    def part(words: str, make, *args) -> list:
        """One part of the explanation, or none where it cannot be made (said in `unread`)."""
        try:
            made = make(*args)
        except Exception:  # noqa: BLE001 - a diagnosis names what it can
            unread[words] += 1
            return []
        if made is None:
            return []
        return [made] if type(made) is _Finding else list(made)

    findings = part("the .grad graphs", _grad_finding, baseline, now, grads, live, ledger)
    grown = _candidates(growth(baseline, now, top=len(now.count)), top)
    members = _members(counted, {g.group for g in grown})
    namer.ignore(*members.values())
    in_groups: set[int] = set()
    held_by_graphs = []
    for g in grown:
        group_members = members[g.group]
        held = [t for t in group_members if kept_by_python(t)]
        namer.ignore(held)
        if len(held) * 2 >= len(group_members):
            in_groups.update(map(id, held))
            findings += part(f"the holder of {g.group.describe()}", _group_finding, g, held, namer, ledger, sites)
        else:  # mostly saved tensors of some graph: told with the graph that keeps them
            held_by_graphs.append((g, group_members))
    roots = [t for t in graph_tensors if id(t) not in in_groups and kept_by_python(t)]
    namer.ignore(roots)
    findings += part("the graphs' roots", _graph_root_findings, baseline, now, roots, namer, ledger, sites)
    for g, group_members in held_by_graphs:
        findings += part(f"the graph of {g.group.describe()}", _saved_group_finding, g, group_members, ledger, sites)
    now.hooks = _count_hooks(live.modules)
    findings += part("the module hooks", _hook_findings, baseline, now, live.modules)
    candidates = [t for t in live.tensors if kept_by_python(t)]
    namer.ignore(candidates)
    findings += part("the largest tensors", _grown_tensor_findings, baseline, candidates, namer, sites)
    now.xla = _xla_activity(unread)
    findings += part("torch_xla's pending graph", _xla_findings, baseline.xla, now.xla, live, namer)
    if not grown:  # no tensors nor buffers explain it: which Python objects pile up, and what grows with them
        findings += part("the Python objects", _object_findings, baseline, live, namer)
    shown = sorted((f for f in findings if f is not None and f.shown), key=lambda f: (f.rank, -f.bytes_))
    return [f.line() for f in shown[:top + MORE_LINES]]


MIN_OBJECTS = 10_000  # growth by fewer instances of a type is the interpreter's own churn
# Types are counted on every 17th object the collector tracks, scaled back. Prime: objects made in a
# repeating pattern (an instance and its list, a key and its value: every other object) fell on an
# even stride all on one side, and a leak of 20,000 instances was counted as none of them.
TYPE_STRIDE = 17
_KEY_OF = re.compile(r"^key .{0,200}? of (?=dict of )")
OBJECT_TYPES_NAMED = 2


def _object_findings(baseline: Census, live: _Live, namer: Namer) -> list[_Finding]:
    """The types whose tracked instances grew most since the baseline (by at least `MIN_OBJECTS`,
    and by half their number then), told as the container that grows with them and the record it
    holds (`records`); where no container grew with them, by type, with a shallow size and the
    holder of the newest ones. Types one record holds are told once, in its line."""
    before = Counter({key: count * TYPE_STRIDE for key, count in baseline.types.items()})
    grown = sorted(((key, (count - baseline.types.get(key, 0)) * TYPE_STRIDE) for key, count in live.types.items()),
                   key=lambda item: -item[1])
    grown = [(live.kinds[key], added) for key, added in grown if added >= MIN_OBJECTS and added * 2 >= before.get(key, 0)]
    findings, told = [], set()
    for kind, added in grown:
        if len(findings) >= OBJECT_TYPES_NAMED:
            break
        if id(kind) in told:
            continue
        instances = [obj for obj in gc.get_objects() if type(obj) is kind]
        newest, samples = instances[-16:], records.spread(instances)
        namer.ignore(instances, newest, samples)
        found = records.grown_records(samples, kind, added, namer.referrers, baseline.sizes) if samples else None
        instances.clear()
        if found is not None:
            together = [(k, a) for k, a in grown if id(k) in found.per_entry]
            told.update(id(k) for k, _ in together)
            findings.append(_records_finding(found, together, namer))
            continue
        size = peek.shallow_size(newest[-1]) if newest else 0
        # "key 27560 of dict of 30000 (...)" per member: the dict itself is the holder of them all
        holders = tuple(dict.fromkeys(_KEY_OF.sub("", words) for words in namer.holders_of(newest))) if newest else ()
        finding = _Finding(1, bytes_=added * size)
        finding.text = (f"about +{added:,} Python objects {peek.type_name(kind)} (+{format_bytes(added * size)} shallow)"
                        + (f"; held by {', '.join(holders)}" if holders else ""))
        findings.append(finding)
    return findings


def _records_finding(found: records.Records, together: list, namer: Namer) -> _Finding:
    """"about +118,000 entries of (Spec, Spec) in dict 'cache' of Optimizer (118,016 now), about
    +33.0 MiB; Python objects among them: about +472,000 tuple, +236,000 train.Spec"."""
    entries = found.grew
    grown_bytes = entries * found.entry_bytes
    namer.ignore(found)  # it refers to the container too
    kinds = ", ".join(f"+{added:,} {peek.type_name(kind)}" for kind, added in together[:4])
    more = f" and {len(together) - 4} more" if len(together) > 4 else ""
    text = (f"about +{entries:,} entries of {found.record} in {namer.place_of(found.container)} "
            f"({peek.length(found.container):,} now), about +{format_bytes(grown_bytes)}; "
            f"Python objects among them: about {kinds}{more}")
    return _Finding(1, grown_bytes, text)


def _candidates(grown: list[Growth], top: int) -> list[Growth]:
    """The `top` groups that grew most in bytes, and the next few that hold autograd graphs: a
    list of scalar losses is small itself and keeps each step's activations."""
    with_graphs = [g for g in grown[top:] if g.group.has_graph][:MORE_LINES]
    return grown[:top] + with_graphs


def _members(tensors: list, groups: set[TensorGroup]) -> dict[TensorGroup, list]:
    found: dict[TensorGroup, list] = {g: [] for g in groups}
    for tensor in tensors:
        try:
            group = group_of(tensor)
        except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
            continue
        if group in found:
            found[group].append(tensor)
    return found


def _created(tensors: list, sites: CreationSites | None) -> str:
    if sites is None:
        return ""
    found = sites.commonest_site(tensors)
    return f", created at {found[0]}" if found is not None else ""


def _graph_words(graph: GraphSize) -> str:
    packed = (f", {graph.packed:,} more packed by saved-tensor hooks (checkpointing) and not counted"
              if graph.packed else "")
    if not graph.saved_tensors:
        freed = "" if graph.packed else " (its saved tensors already freed by a backward)"
        return f"an autograd graph of {graph.nodes:,} nodes{freed}{packed}"
    return (f"an autograd graph of {graph.nodes:,} nodes with {format_bytes(graph.saved_bytes)} "
            f"of saved tensors ({graph.saved_tensors:,} buffers{packed})")


def _group_finding(g: Growth, held: list, namer: Namer, ledger: _Ledger, sites) -> _Finding:
    finding = _Finding(1)
    graph = ledger.walk((g for g in map(_grad_fn, held) if g is not None), finding)
    text = Growth(g.group, g.added_tensors, g.added_bytes).describe()
    if graph.nodes:
        text += f", keeping {_graph_words(graph)}"
    text += _created(held, sites)
    holders = namer.holders_of(held)
    finding.text = text + (f"; held by {', '.join(holders)}" if holders else "")
    finding.bytes_ = g.added_bytes + graph.saved_bytes
    return finding


def _saved_group_finding(g: Growth, group_members: list, ledger: _Ledger, sites) -> _Finding | None:
    """A grown group of tensors kept only as saved tensors of a graph: told with that graph's line."""
    owners = Counter(ledger.owner.get(_key(t)) for t in group_members)
    owner = owners.most_common(1)[0][0] if owners else None
    words = f"+{g.added_tensors} {g.group.describe(graph=True)} (+{format_bytes(g.added_bytes)})"
    created = _created(group_members, sites)
    if owner is not None and owner.shown:
        owner.among.append(words + created)
        return None
    return _Finding(1, g.added_bytes, f"{Growth(g.group, g.added_tensors, g.added_bytes).describe()}{created}; "
                                      f"held by no Python object: saved for backward by an autograd graph")


def _graph_root_findings(baseline: Census, now: Census, roots: list, namer: Namer, ledger: _Ledger,
                         sites) -> list[_Finding]:
    """The tensors whose own graphs hold growth no group explains (`total += loss`). Every root is
    walked, so it owns its graph; the two that own most of the growth are told."""
    findings = [_Finding(1, shown=False) for _ in roots]
    for root, finding in zip(roots, findings):
        ledger.walk([_grad_fn(root)], finding)
    grew = now.graphs - baseline.graphs
    if grew.saved_bytes < MIN_GRAPH_BYTES and grew.nodes < MIN_GRAPH_NODES:
        return findings
    order = sorted(range(len(roots)), key=lambda i: (-findings[i].graph.saved_bytes, -findings[i].graph.nodes))
    for index in order[:2]:
        finding, tensor = findings[index], roots[index]
        size = finding.graph
        owns_bytes = grew.saved_bytes >= MIN_GRAPH_BYTES and size.saved_bytes >= grew.saved_bytes // 10
        owns_nodes = grew.nodes >= MIN_GRAPH_NODES and size.nodes >= grew.nodes // 10
        if not (owns_bytes or owns_nodes):
            break
        holder = namer.holder_of(tensor)
        finding.text = (f"{_graph_words(size)} (all graphs: +{grew.nodes:,} nodes, "
                        f"+{format_bytes(grew.saved_bytes)} since the baseline), reachable from a "
                        f"{group_of(tensor).describe()} tensor ({peek.short_name(type(_grad_fn(tensor)))})"
                        f"{_created([tensor], sites)}" + (f"; held by {holder}" if holder else ""))
        finding.bytes_, finding.shown = size.saved_bytes, True
    return findings


def _grad_finding(baseline: Census, now: Census, grads: list, live: _Live, ledger: _Ledger) -> _Finding:
    """Parameters' .grad carrying graphs; walked first, so it owns what it reaches either way."""
    finding = _Finding(1, shown=False)
    ledger.walk(live.grad_roots(grads), finding)
    grew = now.grad_graphs - baseline.grad_graphs
    if grew.saved_bytes < MIN_GRAPH_BYTES or not grads:
        return finding
    names = parameter_names(live.modules)
    # Sorted, so the same leak reads the same whatever order the garbage collector listed them in.
    listed = ", ".join(sorted(names.get(id(p), "unnamed parameter") for p in grads)[:3])
    more = f" and {len(grads) - 3} more" if len(grads) > 3 else ""
    finding.text = (f"the .grad of {len(grads)} parameters carries {_graph_words(now.grad_graphs)}, "
                    f"+{grew.nodes:,} nodes and +{format_bytes(grew.saved_bytes)} since the baseline "
                    f"(backward(create_graph=True) with .grad never reset to None); parameters {listed}{more}")
    finding.bytes_, finding.shown = grew.saved_bytes, True
    return finding


def _hook_findings(baseline: Census, now: Census, modules: list) -> list[_Finding]:
    findings = []
    for (path, words), count in now.hooks.items():
        added = count - baseline.hooks.get((path, words), 0)
        if added < 2:
            continue
        newest = _newest_hook(modules, path, words)
        text = (f"+{added} {words}s on {path} since the baseline ({count} now){newest}: "
                f"a hook registered again and again and never removed")
        findings.append(_Finding(2, added, text))
    return findings


def _newest_hook(modules: list, path: str, words: str) -> str:
    attribute = next(a for a, w in MODULE_HOOKS.items() if w == words)
    paths = module_paths(modules)
    for module in modules:
        if paths.get(id(module)) == path:
            attrs = peek.attributes(module)
            table = attrs.get(attribute) if attrs is not None else None
            if table is not None and peek.container_base(type(table)) is dict and peek.length(table):
                hook = list(dict.values(table))[-1]
                if type(hook) is types.MethodType:
                    hook = hook.__func__
                if type(hook) is types.FunctionType:
                    code = hook.__code__
                    where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
                    return f", newest {hook.__qualname__!r} defined at {where}"
    return ""


def _grown_tensor_findings(baseline: Census, tensors: list, namer: Namer, sites) -> list[_Finding]:
    """A tensor bigger than anything live at the baseline: one tensor grown by concatenation."""
    floor = max(2 * baseline.largest_tensor_bytes, MIN_GRAPH_BYTES)
    biggest = max((t for t in tensors if _size(t) > floor), key=_size, default=None)
    if biggest is None:
        return []
    holder = namer.holder_of(biggest)
    text = (f"1 tensor {group_of(biggest).describe()} of {format_bytes(_size(biggest))}, larger than any live "
            f"tensor at the baseline ({format_bytes(baseline.largest_tensor_bytes)}): grown by concatenation"
            f"{_created([biggest], sites)}")
    return [_Finding(1, _size(biggest), text + (f"; held by {holder}" if holder else ""))]


def _xla_findings(before: xla_activity.XlaActivity | None, after: xla_activity.XlaActivity | None, live: _Live,
                  namer: Namer) -> list[_Finding]:
    if before is None or after is None or after.traced_ir_nodes < before.traced_ir_nodes:
        return []  # no XLA, or someone cleared the counters
    findings = []
    traced = after.traced_ir_nodes - before.traced_ir_nodes
    if after.syncs == before.syncs and traced >= MIN_PENDING_IR_NODES:
        findings.append(_Finding(0, traced, _pending_graph_words(before, after, traced, live, namer)))
    compiled = after.compilations - before.compilations
    if compiled >= MIN_NEW_COMPILATIONS:
        findings.append(_Finding(3, compiled, (
            f"+{compiled} XLA compilations since the baseline ({before.compilations} -> {after.compilations}): "
            f"a shape or a Python number changes between steps, and every compiled graph stays cached")))
    return findings


def _pending_graph_words(before, after, traced: int, live: _Live, namer: Namer) -> str:
    earlier = dict(before.ops)
    ops = sorted(((count - earlier.get(op, 0), op) for op, count in after.ops), reverse=True)[:3]
    busiest = ", ".join(f"{op} +{count:,}" for count, op in ops if count > 0)
    names = parameter_names(live.modules)
    device = live.reads.device
    pending = [names.get(id(p), "a parameter") for p in live.parameters
               if device(p).type == "xla" and xla_activity.has_pending_graph(p)]
    carriers = [p for p in pending[:3]]
    if len(carriers) < 3:
        for tensor in live.tensors:
            if device(tensor).type == "xla" and xla_activity.has_pending_graph(tensor):
                holder = namer.holder_of(tensor)
                carriers.append(f"{group_of(tensor).describe()} held by {holder}" if holder else group_of(tensor).describe())
                if len(carriers) >= 3:
                    break
    carried = f"; pending in {', '.join(carriers)}" if carriers else ""
    return (f"no torch_xla.sync() since the baseline (MarkStep still {after.syncs}): {traced:,} IR nodes traced "
            f"since then ({busiest}) wait on the host as one growing graph, with every device buffer it reads"
            f"{carried}")

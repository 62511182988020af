"""Why XLA compiled: torch_xla's compile analysis, parsed, and a recompilation's cause in words. Pure.

torch_xla 2.9 explains each compilation when `PT_XLA_DEBUG_LEVEL` >= 1 (torch_xla/csrc/debug_util.cpp,
`analyze_graph_execution_python_frame` and `post_compilation_analysis`)::

    Compilation Analysis: Compilation Cause
    Compilation Analysis:   most likely user code trying to access tensor value before torch_xla.sync
    Compilation Analysis: Graph Info:
    Compilation Analysis:   Graph Hash: d28b0993a55ac1167693c51c9266ae99
    Compilation Analysis:   Number of Graph Inputs: 3
    Compilation Analysis:   Number of Graph Outputs: 1
    Compilation Analysis: Python Frame Triggered Execution:
    Compilation Analysis:   training_step (/home/me/model.py:88)
    Compilation Analysis:   ...
    Post Compilation Analysis: Graph input size: 0.000001 GB
    Post Compilation Analysis: Graph output size: 0.000000 GB
    ...

The frames are the Python stack of the thread that compiled, innermost first, when it compiled:
for a value read before the sync, the read itself; for a graph compiled at the step's end, the
`torch_xla.sync()` call. What the analysis does not carry is the graph: not the op whose shape
changed, nor the shapes themselves, only the number of inputs and outputs and (at 1 KiB
resolution, in GB) their total sizes. `explain` says as much when that is all there is.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from watchdog.core.errors import InputError
from watchdog.core.numbers import parse_count
from watchdog.core.recompilation import Recompilation
from watchdog.core.units import format_bytes

_COMPILE_PREFIX = "Compilation Analysis:"
_POST_PREFIX = "Post Compilation Analysis:"
_FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>.*):(?P<line>[0-9]{1,9})\)$")  # [0-9]: int() reads any script
_GB = re.compile(r"^(?P<what>[A-Za-z ]+ size): (?P<gb>[0-9.]+) GB$")
_POST_FIELDS = {"Graph input size": "input_bytes", "Graph output size": "output_bytes",
                "Compiled program size": "program_bytes"}

VALUE_READ, STEP_BOUNDARY, DYNAMO, OTHER = "value_read", "step_boundary", "dynamo", "other"
_PLUMBING = {"sync", "mark_step", "wrapper"}  # torch_xla's sync and its aliases: the cut, not a cause


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int


@dataclass
class CompileRecord:
    """One compilation as torch_xla's analysis reported it."""

    cause: str = ""
    graph_hash: str | None = None
    inputs: int | None = None
    outputs: int | None = None
    frames: tuple[Frame, ...] = ()
    frames_truncated: bool = False
    input_bytes: int | None = None
    output_bytes: int | None = None
    program_bytes: int | None = None

    @property
    def kind(self) -> str:
        text = self.cause.lower()
        if "access tensor value" in text:
            return VALUE_READ
        if "dynamo" in text:
            return DYNAMO
        if "sync" in text or "mark_step" in text or "torch_xla.compile" in text:
            return STEP_BOUNDARY
        return OTHER


def parse_compile_analysis(text: str) -> list[CompileRecord]:
    """Every complete `Compilation Analysis` block in `text`, with its `Post Compilation` sizes.

    A block cut off at the end (torch_xla was still writing it) is kept only if its frames were
    read; a post-compilation block attaches to the compilation before it.
    """
    records: list[CompileRecord] = []
    record: CompileRecord | None = None
    section = ""
    for raw in text.splitlines():
        if raw.startswith(_POST_PREFIX):
            body = raw[len(_POST_PREFIX):].strip()
            match = _GB.match(body)
            if match and record is not None and match["what"] in _POST_FIELDS:
                setattr(record, _POST_FIELDS[match["what"]], round(float(match["gb"]) * (1 << 30)))
            continue
        if not raw.startswith(_COMPILE_PREFIX):
            continue
        body = raw[len(_COMPILE_PREFIX):]
        stripped = body.strip()
        if stripped == "Compilation Cause":
            record = CompileRecord()
            records.append(record)
            section = "cause"
        elif record is None:
            continue
        elif stripped.startswith("Graph Info"):
            section = "graph"
        elif stripped.startswith("Python Frame Triggered"):
            section = "frames"
        elif stripped.startswith("---") or stripped.startswith("==="):
            section = ""
        elif section == "cause" and stripped:
            record.cause = f"{record.cause} {stripped}".strip()
        elif section == "graph":
            key, _, value = stripped.partition(":")
            value = value.strip()
            if key == "Graph Hash":
                record.graph_hash = value
            elif key == "Number of Graph Inputs":
                record.inputs = _count(value, record.inputs)
            elif key == "Number of Graph Outputs":
                record.outputs = _count(value, record.outputs)
        elif section == "frames":
            match = _FRAME.match(stripped)
            if match:
                record.frames += (Frame(match["function"], match["file"], int(match["line"])),)
            elif stripped.startswith(".."):
                record.frames_truncated = True
    return [r for r in records if r.frames or r.graph_hash]


def _count(text: str, otherwise: int | None) -> int | None:
    """A count torch_xla printed, or `otherwise` when it is not one (ASCII digits, bounded: a mangled
    report is no reason to stop a training run)."""
    try:
        return parse_count(text)
    except InputError:
        return otherwise


@dataclass(frozen=True)
class Cause:
    """A recompilation's cause in words, with the user's line where the runtime gave it."""

    kind: str
    """value_read, graph_changes, dynamo, stopped or unknown."""
    message: str
    file: str | None = None
    line: int | None = None
    function: str | None = None
    code: str | None = None
    compiles_seen: int = 0
    """Compilations whose analysis was read in the capture window."""
    graphs: int = 0
    """Distinct graphs among them."""

    def fields(self) -> dict:
        return {"cause": self.kind, "message": self.message, "file": self.file, "line": self.line,
                "function": self.function, "code": self.code, "compiles_explained": self.compiles_seen,
                "distinct_graphs": self.graphs}


@dataclass(frozen=True)
class SourceView:
    """How the runtime shows code: which files are libraries, a file's line, a short path."""

    is_library: Callable[[str], bool] = lambda path: False
    code_at: Callable[[str, int], str | None] = lambda path, line: None
    shorten: Callable[[str], str] = lambda path: path


def explain(found: Recompilation, records: Iterable[CompileRecord], *, compiles_in_window: int,
            window_steps: int, unavailable: str | None = None, source: SourceView = SourceView()) -> Cause:
    """The cause of `found`, from the compilations captured after it (`records`).

    `compiles_in_window` is what the counter says was compiled meanwhile (the analysis may have
    said nothing: it was off, or another process writes it); `unavailable` is the runtime's
    reason when it knows the analysis cannot be read.
    """
    records = list(records)
    head = f"XLA compiles a new graph {found.every} after warm-up ({found.compiles_after_warmup} since, " \
           f"{found.warmup_compiles} during warm-up)"
    if not records:
        if unavailable is None and compiles_in_window == 0:
            return Cause("stopped", f"{head}; none in the {window_steps} steps after that, so the cause was "
                                    f"not captured: the recompilation stopped")
        reason = unavailable or ("torch_xla's compile analysis reported none of the "
                                 f"{compiles_in_window} compilations since (it was off when torch_xla "
                                 "compiled its first graph, and it is read only once per process)")
        return Cause("unknown", f"{head}; cause unknown: {reason}")

    groups = Counter((r.kind, _user_frame(r, source)) for r in records)
    (kind, frame), count = groups.most_common(1)[0]
    chosen = [r for r in records if (r.kind, _user_frame(r, source)) == (kind, frame)]
    graphs = len({r.graph_hash for r in chosen if r.graph_hash} or {None})
    code = source.code_at(frame.file, frame.line) if frame is not None else None
    where = _where(frame, code, source)
    through = _through(chosen[0], frame, source)
    graph_change = _graph_change(chosen)
    others = len(records) - count
    tail = f" ({others} other compilation{'s' if others != 1 else ''} elsewhere)" if others else ""
    fields = dict(file=frame.file if frame else None, line=frame.line if frame else None,
                  function=frame.function if frame else None, code=code, compiles_seen=len(records), graphs=graphs)

    if kind == VALUE_READ:
        message = (f"graph recompiled {found.every}: {where}{through} reads a tensor before torch_xla.sync(), "
                   f"and the graph it reads {graph_change or 'is new each time'}; "
                   f"{_LIGHTNING_LOG_ADVICE if _is_lightning_log(code, frame) else _READ_ADVICE}{tail}")
        return Cause("value_read", message, **fields)
    if kind == STEP_BOUNDARY:
        inputs = chosen[0].inputs
        same = f"the same {inputs} inputs" if inputs is not None else "the same inputs"
        change = graph_change or (f"has {same} of the same size each time, so the change is inside the graph: "
                                  "a tensor created or reshaped with a size that changes, or a Python number "
                                  "used as a shape")
        message = (f"the step's graph changes {found.every}: each new graph is compiled at {where}{through} "
                   f"(the step's torch_xla.sync()) and {change}. torch_xla's analysis names where the graph "
                   f"was cut and its inputs' count and size, not the op or shape that changed{tail}")
        return Cause("graph_changes", message, **fields)
    if kind == DYNAMO:
        return Cause("dynamo", f"dynamo compiles a new graph {found.every} at {where}{through}{tail}", **fields)
    return Cause("unknown", f"{head}; torch_xla gives the cause as {chosen[0].cause!r} at {where}{through}{tail}",
                 **fields)


_READ_ADVICE = "read it after the sync, or log the detached tensor and let the logger read it later"
# Lightning's best-known pitfall on TPU: a number computed from a device tensor inside a step hook
# and handed to self.log(), so the host waits for a graph cut short, every step.
_LIGHTNING_LOG_ADVICE = ("in Lightning, that is a value read from a device tensor inside a step hook and handed "
                         "to self.log(): pass the tensor itself, detached (self.log(name, loss.detach())), and "
                         "Lightning reads it after the step's sync; or log it on_epoch=True, on_step=False")
_STEP_HOOKS = ("training_step", "validation_step", "test_step", "predict_step")


def _is_lightning_log(code: str | None, frame: Frame | None) -> bool:
    """A `self.log(...)` / `self.log_dict(...)` line inside a LightningModule's step hook."""
    return bool(code and frame and frame.function in _STEP_HOOKS
                and re.search(r"\bself\.log(_dict)?\(", code))


def _user_frame(record: CompileRecord, source: SourceView) -> Frame | None:
    """The innermost frame outside libraries; else the outermost one torch_xla reported."""
    for frame in record.frames:
        if not source.is_library(frame.file):
            return frame
    return record.frames[-1] if record.frames else None


def _where(frame: Frame | None, code: str | None, source: SourceView) -> str:
    if frame is None:
        return "an unknown line (torch_xla reported no Python frame)"
    place = f"{source.shorten(frame.file)}:{frame.line}"
    return f"`{code}` at {place}" if code else f"{frame.function}() at {place}"


def _through(record: CompileRecord, frame: Frame | None, source: SourceView) -> str:
    """The library line between the user's frame and the graph's cut, if there is one."""
    if frame is None or frame not in record.frames:
        return ""
    inside = record.frames[:record.frames.index(frame)]
    named = [f for f in inside if f.function not in _PLUMBING]
    if not named:
        return ""
    return f" (through {named[0].function} in {source.shorten(named[0].file)}:{named[0].line})"


def _graph_change(records: list[CompileRecord]) -> str:
    """How consecutive graphs differ, in what the analysis carries: input count, input size."""
    inputs = [r.inputs for r in records if r.inputs is not None]
    if len(set(inputs)) > 1:
        return "has a different number of inputs each time: " + _sequence(inputs)
    sizes = [r.input_bytes for r in records if r.input_bytes is not None]
    if len(set(sizes)) > 1:
        count = f" ({inputs[0]} inputs)" if inputs else ""
        shown = [format_bytes(s) for s in sizes]
        if len(set(shown)) < len(set(sizes)):
            shown = [f"{s:,} B" for s in sizes]
        return f"has inputs that change size{count}, so an input's shape changes: " + _sequence(shown)
    return ""


def _sequence(values: list) -> str:
    shown = [str(v) for v in values[:4]]
    return " -> ".join(shown) + (" ..." if len(values) > 4 else "")

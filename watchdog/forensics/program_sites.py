"""Which line of the user's Python asked for a program's memory: the traced step's HLO, with its stacks.

XLA's out-of-memory message names each large allocation's op with the one Python frame it keeps
(`source_file` / `source_line`, recorded under `XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1`): the innermost.
Inside a module's `forward`, an `nn.Linear`'s matmul names torch's own `linear.py`, not the line
of the user's model that called the layer. torch_xla also writes every op's whole Python stack
into the program (the HLO module's stack frame index, and each op's `stack_frame_id`), so the
user's line is in there: the nearest frame outside torch, torch_xla, the standard library and the
installed packages (the creation-site capture skips the same frames).

`program_sites(tensors)` lowers the pending graph that computes `tensors` to HLO (no compilation,
no execution, no transfer: the graph stays pending for the step's sync), reads it with the part of
XLA's schema it needs (`hlo.proto`, `xla_data.proto`: built here, the protobuf runtime parses the
rest as unknown fields) and returns its largest ops, each with its innermost frame and the user's.
The trainer keeps that table in its flight record; `postmortem` matches an out-of-memory
message's allocations to it by op name and shape.
"""

from __future__ import annotations

import os
import sysconfig
import time
from functools import lru_cache
from typing import NamedTuple

from watchdog.logs import get_logger

log = get_logger(__name__)

TOP_OPS = 64  # the largest ops kept: an OOM message lists the largest allocations, a few dozen at most

# xla.PrimitiveType -> (name in HLO text, bytes per element)
_ELEMENTS = {1: ("pred", 1), 2: ("s8", 1), 3: ("s16", 2), 4: ("s32", 4), 5: ("s64", 8), 6: ("u8", 1),
             7: ("u16", 2), 8: ("u32", 4), 9: ("u64", 8), 10: ("f16", 2), 11: ("f32", 4), 12: ("f64", 8),
             15: ("c64", 8), 16: ("bf16", 2), 18: ("c128", 16)}


class ProgramOp(NamedTuple):
    op_name: str
    shape: str  # as XLA prints it in a message, without layout: f32[8,64,64]
    bytes: int
    innermost: str  # file:line, the frame XLA's message names
    user: str | None  # file:line in function: the nearest frame of the user's own code, if any

    def to_json(self) -> dict:
        return self._asdict()


def record_program(flight, tensors) -> None:
    """`Watchdog.record_program`: the largest ops of the step's pending graph into the flight record
    (`flight.observe_program`), logged with their cost; a failure is logged, never raised (a
    diagnosis aid never stops training). Python lines are in the program only under
    XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1."""
    started = time.perf_counter()
    try:
        ops = program_sites(list(tensors))
    except Exception as exc:  # noqa: BLE001 - a diagnosis aid never stops training
        log.warning("program_sites_failed", error=f"{type(exc).__name__}: {exc}")
        return
    flight.observe_program([op.to_json() for op in ops])
    log.info("program_sites_recorded", ops=len(ops), with_user_lines=sum(1 for op in ops if op.user),
             seconds=round(time.perf_counter() - started, 3))


def program_sites(tensors: list, top: int = TOP_OPS) -> list[ProgramOp]:
    """The largest ops of the graph pending for `tensors`, with their frames (torch_xla only)."""
    import torch_xla

    return read_program(torch_xla._XLAC._get_xla_tensors_hlo_proto(tensors), top=top)


def read_program(serialized: bytes, *, top: int = TOP_OPS, library: tuple[str, ...] | None = None) -> list[ProgramOp]:
    """An HloModuleProto's `top` largest array-valued ops, biggest first. `library`: path prefixes
    that are not the user's code (default: torch, torch_xla, the standard library, site-packages)."""
    module = _schema()["Module"]()
    module.ParseFromString(serialized)
    frames = _Frames(module.stack_frame_index, library if library is not None else _library_prefixes())
    ops = []
    for computation in module.computations:
        for instruction in computation.instructions:
            size = _bytes(instruction.shape)
            meta = instruction.metadata
            if not size or not meta.op_name or instruction.opcode == "parameter":
                continue
            innermost = f"{meta.source_file}:{meta.source_line}" if meta.source_file else ""
            ops.append(ProgramOp(meta.op_name, _shape_text(instruction.shape), size, innermost,
                                 frames.user_frame(meta.stack_frame_id)))
    ops.sort(key=lambda op: -op.bytes)
    return ops[:top]


class _Frames:
    """The module's stack frame index: 1-based ids, each frame pointing at its caller."""

    def __init__(self, index, library: tuple[str, ...]):
        self._index, self._library = index, library

    def user_frame(self, frame_id: int) -> str | None:
        index, seen = self._index, 0
        while 0 < frame_id <= len(index.stack_frames) and seen < 256:
            frame = index.stack_frames[frame_id - 1]
            location = index.file_locations[frame.file_location_id - 1]
            path = index.file_names[location.file_name_id - 1] if location.file_name_id else ""
            if path and not os.path.abspath(path).startswith(self._library):
                function = index.function_names[location.function_name_id - 1] if location.function_name_id else "?"
                return f"{path}:{location.line} in {function}"
            frame_id, seen = frame.parent_frame_id, seen + 1
        return None


def _bytes(shape) -> int:
    element = _ELEMENTS.get(shape.element_type)
    if element is None:  # a tuple, a token: no buffer of its own
        return 0
    count = 1
    for dimension in shape.dimensions:
        count *= dimension
    return count * element[1]


def _shape_text(shape) -> str:
    return f"{_ELEMENTS[shape.element_type][0]}[{','.join(map(str, shape.dimensions))}]"


@lru_cache(maxsize=1)
def _library_prefixes() -> tuple[str, ...]:
    import torch

    prefixes = {os.path.dirname(os.path.abspath(torch.__file__)) + os.sep}
    try:
        import torch_xla

        prefixes.add(os.path.dirname(os.path.abspath(torch_xla.__file__)) + os.sep)
    except ImportError:
        pass
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        if paths.get(key):
            prefixes.add(os.path.abspath(paths[key]) + os.sep)
    return tuple(sorted(prefixes))


@lru_cache(maxsize=1)
def _schema() -> dict:
    """The few messages of XLA's HLO schema read here, with XLA's field numbers."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="hbm_watchdog/hlo_subset.proto", package="hbmwatch.hlo",
                                           syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, str | None, bool]) -> None:
        described = f.message_type.add(name=name)
        for field_name, number, kind, type_name, repeated in fields:
            field = described.field.add(name=field_name, number=number, type=kind,
                                        label=proto.LABEL_REPEATED if repeated else proto.LABEL_OPTIONAL)
            if type_name:
                field.type_name = f".hbmwatch.hlo.{type_name}"

    i32, i64, text, sub = proto.TYPE_INT32, proto.TYPE_INT64, proto.TYPE_STRING, proto.TYPE_MESSAGE
    message("FileLocation", ("file_name_id", 1, i32, None, False), ("function_name_id", 2, i32, None, False),
            ("line", 3, i32, None, False))
    message("StackFrame", ("file_location_id", 1, i32, None, False), ("parent_frame_id", 2, i32, None, False))
    message("StackFrameIndex", ("file_names", 1, text, None, True), ("function_names", 2, text, None, True),
            ("file_locations", 3, sub, "FileLocation", True), ("stack_frames", 4, sub, "StackFrame", True))
    message("OpMetadata", ("op_type", 1, text, None, False), ("op_name", 2, text, None, False),
            ("source_file", 3, text, None, False), ("source_line", 4, i32, None, False),
            ("stack_frame_id", 15, i32, None, False))
    message("Shape", ("element_type", 2, i32, None, False), ("dimensions", 3, i64, None, True))
    message("Instruction", ("name", 1, text, None, False), ("opcode", 2, text, None, False),
            ("shape", 3, sub, "Shape", False), ("metadata", 7, sub, "OpMetadata", False))
    message("Computation", ("name", 1, text, None, False), ("instructions", 2, sub, "Instruction", True))
    message("Module", ("name", 1, text, None, False), ("computations", 3, sub, "Computation", True),
            ("stack_frame_index", 17, sub, "StackFrameIndex", False))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"hbmwatch.hlo.{name}"))
            for name in ("Module", "Computation", "Instruction", "StackFrameIndex")}

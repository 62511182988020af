"""The map from XLA's out-of-memory message back to the user's own Python line.

XLA's message names an allocation's innermost frame (torch's `linear.py` for a layer's matmul);
the traced program holds every op's whole stack. The pure tests build a program in XLA's own
serialized layout (the same field numbers, through the schema `read_program` reads with); the
slow test reads the instrumented trainer's real program on PJRT CPU, and `postmortem` maps a
message made of that program's largest ops back to the model file's lines.
"""

import json
import os

import pytest

from conftest import json_lines
from watchdog.core.oom_message import parse
from watchdog.core.postmortem import user_lines
from watchdog.forensics.program_sites import _schema, read_program

TORCH = "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py"
MODEL = "/home/me/model.py"
LIBRARY = ("/venv/lib/python3.11/",)


def _program(ops) -> bytes:
    """A module whose ops each carry a stack: innermost `inner` (file, line), called from `caller`."""
    schema = _schema()
    module = schema["Module"]()
    index = module.stack_frame_index
    files, functions = [], []

    def frame(path: str, line: int, function: str, parent: int) -> int:
        for table, value in ((files, path), (functions, function)):
            if value not in table:
                table.append(value)
        index.file_locations.add(file_name_id=files.index(path) + 1,
                                 function_name_id=functions.index(function) + 1, line=line)
        index.stack_frames.add(file_location_id=len(index.file_locations), parent_frame_id=parent)
        return len(index.stack_frames)

    computation = module.computations.add(name="main")
    for name, dims, inner, caller in ops:
        outer = frame(*caller, 0)
        innermost = frame(*inner, outer)
        instruction = computation.instructions.add(name=name, opcode="dot")
        instruction.shape.element_type = 11  # F32
        instruction.shape.dimensions.extend(dims)
        instruction.metadata.op_name = name
        instruction.metadata.source_file, instruction.metadata.source_line = inner[0], inner[1]
        instruction.metadata.stack_frame_id = innermost
    index.file_names.extend(files)
    index.function_names.extend(functions)
    return module.SerializeToString()


def test_each_op_is_traced_past_the_libraries_to_the_users_line_biggest_first():
    serialized = _program([
        ("aten__addmm", [8, 64], (TORCH, 134, "forward"), (MODEL, 88, "forward")),
        ("aten__mm", [64, 4096, 4096], (TORCH, 134, "forward"), (MODEL, 91, "attend")),
        ("aten__relu", [8, 64], (MODEL, 92, "forward"), (MODEL, 120, "train_step")),
    ])
    ops = read_program(serialized, library=LIBRARY)
    assert [op.op_name for op in ops] == ["aten__mm", "aten__addmm", "aten__relu"]
    assert ops[0].shape == "f32[64,4096,4096]" and ops[0].bytes == 64 * 4096 * 4096 * 4
    assert ops[0].innermost == f"{TORCH}:134" and ops[0].user == f"{MODEL}:91 in attend"
    assert ops[2].user == f"{MODEL}:92 in forward"  # the user's own op: its innermost frame is the user's
    assert read_program(serialized, top=1, library=LIBRARY) == ops[:1]
    only_library = read_program(serialized, library=("/",))
    assert {op.user for op in only_library} == {None}  # nothing outside the libraries: no user line


COMPILE_OOM = """\
Ran out of memory in memory space hbm. Used 20.00G of 16.00G hbm. Exceeded hbm capacity by 4.00G.
  Largest program allocations in hbm:

  1. Size: 4.00G
     Operator: op_name="aten__mm" source_file="{torch}" source_line=134
     Shape: f32[64,4096,4096]{{1,2,0:T(8,128)}}
     Allocation type: HLO temp
     ==========================

  2. Size: 2.00K
     Operator: op_name="aten__addmm" source_file="{torch}" source_line=134
     Shape: f32[8,64]{{1,0}}
     Allocation type: HLO temp
     ==========================
"""


def test_a_messages_allocations_are_traced_to_the_users_lines():
    program = [op.to_json() for op in read_program(_program([
        ("aten__addmm", [8, 64], (TORCH, 134, "forward"), (MODEL, 88, "forward")),
        ("aten__mm", [64, 4096, 4096], (TORCH, 134, "forward"), (MODEL, 91, "attend")),
    ]), library=LIBRARY)]
    message = parse(COMPILE_OOM.format(torch=TORCH))
    assert [s.file for s in message.python_sites] == [TORCH]  # all XLA can say: torch's line
    lines = user_lines(message, program)
    assert [(line.where, line.bytes, line.allocations) for line in lines] == [
        (f"{MODEL}:91 in attend", 4 << 30, 1), (f"{MODEL}:88 in forward", 2 << 10, 1)]
    assert lines[0].named_by_xla == (f"{TORCH}:134",)
    assert user_lines(message, []) == [] and user_lines(None, program) == []


def test_one_op_that_could_be_any_of_several_lines_names_them_all():
    program = [op.to_json() for op in read_program(_program([
        ("aten__mm", [64, 4096, 4096], (TORCH, 134, "forward"), (MODEL, 91, "attend")),
        ("aten__mm", [64, 4096, 4096], (TORCH, 134, "forward"), (MODEL, 97, "attend")),
    ]), library=LIBRARY)]
    (line,) = user_lines(parse(COMPILE_OOM.format(torch=TORCH)), program)
    assert line.where == f"{MODEL}:91 in attend or {MODEL}:97 in attend"


@pytest.mark.slow
def test_the_trainers_largest_ops_map_to_its_model_files_lines_and_postmortem_names_them(tmp_path, run_cli):
    """On PJRT CPU, under --hlo-source-lines: the program of the trainer's first step is recorded
    beside the trace; its largest ops point, past torch's own files, at the lines of
    watchdog/trainer/model.py that call the layers; and a message listing those ops (as XLA would on
    a TPU that ran out) is traced back to those lines by `postmortem`."""
    trace = tmp_path / "trace.csv"
    out = run_cli("train", "--hlo-source-lines", "--steps", "3", "--memory-limit", "8GiB", "--trace-file", str(trace),
                  "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr[-3000:]
    (recorded,) = [e for e in json_lines(out.stderr) if e.get("event") == "program_sites_recorded"]
    program = json.loads((tmp_path / "trace.csv.flight.json").read_text())["program_sites"]
    assert len(program) == recorded["ops"] > 10
    model = os.path.join("watchdog", "trainer", "model.py")
    largest = [op for op in program[:10] if op["user"]]
    assert len(largest) >= 8 and all(model in op["user"] for op in largest), program[:10]
    through_torch = [op for op in program if op["user"] and "/torch/" in op["innermost"]]
    assert through_torch and all(model in op["user"] for op in through_torch)  # past nn.Linear's own file

    ops = [op for op in program if op["user"] and "/torch/" in op["innermost"]][:3]
    entries = "".join(
        f"\n  {n}. Size: {op['bytes'] / 1024:.2f}K\n     Operator: op_name=\"{op['op_name']}\" "
        f"source_file=\"{op['innermost'].rsplit(':', 1)[0]}\" source_line={op['innermost'].rsplit(':', 1)[1]}\n"
        f"     Shape: {op['shape']}{{1,0}}\n     Allocation type: HLO temp\n     ==========================\n"
        for n, op in enumerate(ops, 1))
    log = tmp_path / "job.log"
    log.write_text("step 3 ...\nRESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                   "space hbm. Used 17.00G of 16.00G hbm. Exceeded hbm capacity by 1.00G.\n"
                   f"  Largest program allocations in hbm:\n{entries}")
    report = run_cli("postmortem", str(tmp_path), "--log", str(log))
    assert report.returncode == 0, report.stderr[-2000:]
    assert "your lines behind those allocations" in report.stdout, report.stdout
    mapped = report.stdout.split("your lines behind those allocations", 1)[1]
    assert "watchdog/trainer/model.py:" in mapped and "XLA names" in mapped and "torch/" in mapped
    as_json = json.loads(run_cli("postmortem", str(tmp_path), "--log", str(log), "--json").stdout)
    assert "the largest allocations come from your lines" in as_json["explanation"]
    assert "watchdog/trainer/model.py:" in as_json["explanation"]
